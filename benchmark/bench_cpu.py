"""The CPU figures of chapter 21: minisgl's offline LLM against HF transformers in one run.

    python benchmark/bench_cpu.py --out benchmark/results/2026-12-02-cpu-ch21_cpu
    python benchmark/bench_cpu.py --quick      # 冒烟测试：极小的规模、各 1 轮，几十秒；数字不可发表

SmolLM2-135M-Instruct，float32，贪心，忽略 EOS；两边同一个进程、同样的 torch 线程数。三项测量：

1. quickstart：examples/ch00_quickstart.py 的三个提示词、各 16 个 token，我们的 LLM.generate
   与 HF generate（三个提示词左填充成一批）各跑一次的时间，以及两边的 token 是否相同；
2. 线程数：batch 为 1 时一步 decode 的时间，线程数取 1、2、物理核数和 2 倍物理核数（超额订阅）。
   一步 decode = (生成 1+S 个 token 的时间 - 生成 1 个 token 的时间) / S，两边都这样算，
   prefill 和每次调用的固定开销在相减时抵消；
3. 吞吐随 batch 变化：B 个随机 token id 的提示词（长度在 32～128 之间均匀，种子固定），
   各 32 个 token。我们一次 LLM.generate；HF 把提示词左填充到最长的一个，带 attention mask，
   每一行都算到最长的长度。tok/s 只数有用的输出 token（B × 32），两边相同。

每项都先各跑一次预热，再轮流计时（我们、HF、我们、……），取中位数。我们这边用
cache_type="naive"：和 HF 一样每轮重算整个提示词，不借前缀缓存。
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import transformers  # noqa: E402
from bench_serving import workload  # noqa: E402
from ch00_quickstart import PROMPTS  # noqa: E402
from ch11_speed import Run, cpu_model, hf_batched, measure, ours  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.utils.device import physical_cores  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
DECODE_PROMPT = list(range(1000, 1032))  # 32 tokens, as examples/ch06_speed.py
PROMPT_RANGE = (32, 128)
SEED = 0


class Report:
    """Prints each line as it comes and keeps it for PREFIX.txt."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def command_line() -> str:
    """The command as typed, with paths inside the repository made relative to its root."""
    def rel(arg: str) -> str:
        path = Path(arg)
        if path.is_absolute() and path.resolve().is_relative_to(ROOT):
            return str(path.resolve().relative_to(ROOT))
        return arg
    script = Path(sys.argv[0]).resolve()
    script_arg = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join(["python", script_arg] + [rel(a) for a in sys.argv[1:]])


def timed(runs: dict[str, Run], reps: int, desc: str) -> tuple[dict[str, float], dict]:
    """ch11_speed.measure (one warm-up run each, then `reps` rounds taken in turns) with a
    progress bar on stderr; the median seconds of each run and the tokens of its last round."""
    with tqdm(total=(reps + 1) * len(runs), desc=desc, file=sys.stderr, leave=False) as bar:
        def ticking(run: Run) -> Run:
            def wrapped() -> list[list[int]]:
                out = run()
                bar.update(1)
                return out
            return wrapped
        times, tokens = measure({name: ticking(run) for name, run in runs.items()}, reps)
    return {name: statistics.median(ts) for name, ts in times.items()}, tokens


def quickstart(llm: LLM, hf: torch.nn.Module, pad_id: int, max_tokens: int, reps: int,
               say: Callable[[str], None]) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]  # what LLM.generate does with the text
    runs: dict[str, Run] = {
        "ours": lambda: [list(o["token_ids"]) for o in llm.generate(PROMPTS, params)],
        "hf": hf_batched(hf, pad_id, ids, params)}
    med, tokens = timed(runs, reps, "quickstart")
    n = len(PROMPTS) * max_tokens
    same = sum(a == b for a, b in zip(tokens["ours"], tokens["hf"]))
    say(f"1. quickstart: examples/ch00_quickstart.py's {len(PROMPTS)} prompts, {max_tokens} "
        f"new tokens each ({n} in all), greedy; HF left-pads them into one batch; medians of "
        f"{reps} round(s) in turns")
    for name, label in (("ours", "minisgl LLM.generate"), ("hf", "HF generate")):
        say(f"  {label:<22} {med[name]:6.2f} s, {n / med[name]:6.1f} tok/s")
    say(f"  HF / minisgl: {med['hf'] / med['ours']:.2f}x; tokens equal for {same} of "
        f"{len(PROMPTS)} prompts")
    return {"ours_s": med["ours"], "hf_s": med["hf"], "ours_tok_s": n / med["ours"],
            "hf_tok_s": n / med["hf"], "tokens_equal": same == len(PROMPTS), "new_tokens": n}


def decode_steps(llm: LLM, hf: torch.nn.Module, pad_id: int, cores: int, steps: int,
                 reps: int, say: Callable[[str], None]) -> list[dict]:
    """At 1, 2, the physical core count and twice it (oversubscribed) threads."""
    short = SamplingParams(max_tokens=1, ignore_eos=True)
    long = SamplingParams(max_tokens=1 + steps, ignore_eos=True)
    say(f"2. one decode step at batch 1, a {len(DECODE_PROMPT)}-token prompt: (time of 1+{steps} "
        f"tokens - time of 1 token) / {steps}, medians of {reps} round(s) in turns")
    rows = []
    for k in sorted({1, 2, cores, 2 * cores}):
        torch.set_num_threads(k)
        runs: dict[str, Run] = {
            "ours_1": ours(llm, [DECODE_PROMPT], short),
            "ours_n": ours(llm, [DECODE_PROMPT], long),
            "hf_1": hf_batched(hf, pad_id, [DECODE_PROMPT], short),
            "hf_n": hf_batched(hf, pad_id, [DECODE_PROMPT], long)}
        med, _ = timed(runs, reps, f"{k} threads")
        row = {"threads": k, "ours_ms": (med["ours_n"] - med["ours_1"]) / steps * 1e3,
               "hf_ms": (med["hf_n"] - med["hf_1"]) / steps * 1e3}
        note = " (more threads than cores)" if k > cores else ""
        say(f"  {k:>3} threads: minisgl {row['ours_ms']:6.1f} ms, HF {row['hf_ms']:6.1f} ms "
            f"(HF / minisgl = {row['hf_ms'] / row['ours_ms']:.2f}x){note}")
        rows.append(row)
    return rows


def sweep(llm: LLM, hf: torch.nn.Module, pad_id: int, batches: list[int], max_tokens: int,
          reps: int, say: Callable[[str], None]) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    vocab = llm.vocab_size
    say(f"3. offline throughput: B prompts of random ids, {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} "
        f"tokens (uniform, seed {SEED}), {max_tokens} new tokens each, greedy; medians of {reps} "
        f"round(s) in turns; HF left-pads to the longest prompt with an attention mask, every row "
        f"runs to the longest; tok/s counts the B x {max_tokens} useful tokens on both sides")
    say(f"  {'B':>3}  {'minisgl s':>9}  {'tok/s':>7}  {'HF s':>7}  {'tok/s':>7}  {'HF/ours':>7}"
        f"  same tokens")
    rows = []
    for b in batches:
        prompts = [p for p, _ in workload(b, PROMPT_RANGE, (max_tokens, max_tokens), vocab, SEED)]
        runs = {"ours": ours(llm, prompts, params), "hf": hf_batched(hf, pad_id, prompts, params)}
        med, tokens = timed(runs, reps, f"batch {b}")
        n = b * max_tokens
        same = sum(x == y for x, y in zip(tokens["ours"], tokens["hf"]))
        row = {"batch": b, "ours_tok_s": n / med["ours"], "hf_tok_s": n / med["hf"],
               "ours_s": med["ours"], "hf_s": med["hf"], "equal_rows": same}
        say(f"  {b:>3}  {med['ours']:9.2f}  {row['ours_tok_s']:7.1f}  {med['hf']:7.2f}  "
            f"{row['hf_tok_s']:7.1f}  {med['hf'] / med['ours']:6.2f}x  {same} of {b}")
        rows.append(row)
    return rows


def rounded(x: object) -> object:
    """Floats to 4 significant digits, for a readable JSON file."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description="minisgl's offline LLM against HF on the CPU")
    parser.add_argument("--out", help="write PREFIX.txt (the printed text) and PREFIX.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=32, help="S, decode steps timed per run")
    parser.add_argument("--thread-reps", type=int, default=5, help="rounds per thread count")
    parser.add_argument("--reps", type=int, default=5, help="rounds of quickstart and the sweep")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny sizes, 1 round; not for published figures")
    args = parser.parse_args()
    qs_tokens, sweep_tokens = 16, 32
    if args.quick:
        args.batches, args.steps, args.thread_reps, args.reps = [1, 2], 4, 1, 1
        qs_tokens, sweep_tokens = 4, 4
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL.relative_to(ROOT)} is missing: python tools/models.py smollm2")

    load_start = os.getloadavg()
    cmd, today, cores = command_line(), datetime.date.today().isoformat(), physical_cores()
    machine = f"{cpu_model()}, {os.cpu_count()} logical CPUs, {cores} physical cores"
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    say = Report()
    llm = LLM(str(MODEL), dtype=torch.float32, cache_type="naive")
    default_threads = torch.get_num_threads()  # the Engine's choice: one per physical core
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    pad_id = llm.tokenizer.pad_token_id
    say(f"machine: {machine}; torch {versions['torch']}, transformers "
        f"{versions['transformers']}, python {versions['python']}; date {today}")
    say(f"{MODEL.name}, float32; {default_threads} torch threads on both sides (the Engine's "
        f"choice) except in 2.; minisgl with cache_type=naive (no prefix cache, as HF)")
    say("load average at start (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in load_start))
    if args.quick:
        say("QUICK: a smoke test with tiny sizes and 1 round; not figures to publish")
    start = time.perf_counter()

    qs = quickstart(llm, hf, pad_id, qs_tokens, args.reps, say)
    threads = decode_steps(llm, hf, pad_id, cores, args.steps, args.thread_reps, say)
    torch.set_num_threads(default_threads)
    rows = sweep(llm, hf, pad_id, args.batches, sweep_tokens, args.reps, say)

    load_end = os.getloadavg()
    say("load average at end (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in load_end))
    say(f"measured in {time.perf_counter() - start:.0f} s")
    llm.shutdown()
    if args.out:
        header = f"# {cmd} · {cpu_model()}, {os.cpu_count()} logical CPUs · {today}"
        Path(f"{args.out}.txt").write_text("\n".join([header, *say.lines]) + "\n")
        result = rounded({"bench": "cpu", "machine": machine, "date": today, "versions": versions,
                  "command": cmd, "quick": args.quick,
                  "load_avg": [list(load_start), list(load_end)], "quickstart": qs,
                  "threads": threads, "sweep": rows})
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}.txt and {args.out}.json", file=sys.stderr)


if __name__ == "__main__":
    main()
