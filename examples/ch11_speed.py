"""第 11 章示例：CPU 上我们的 LLM.generate 与 HF transformers 的 generate（左填充成一批）谁快。
SmolLM2-135M-Instruct，float32，两边同一个进程、同样的 torch 线程数。

    python examples/ch11_speed.py                       # 三种负载，各 5 轮
    python examples/ch11_speed.py --workload mixed --reps 10
    python examples/ch11_speed.py --quick               # 冒烟：每种负载 1 轮、4 个 token，不热身

负载：
- mixed：8 个长短不一的提示词（取自 tools/tiny_corpus.txt，16～320 个 token），贪心，
  各 32 个 token；
- nano：nano-vllm 的示例负载放大到 32 个对话提示词，temperature=0.6，各 256 个 token，忽略 EOS；
- loaded：mixed，但同时有另一个进程占满一个核（看两边各慢了多少）。
每种负载先各跑一次预热，再轮流计时（我们、HF、我们、……），取中位数。我们这边用
cache_type="naive"：和 HF 一样每轮重算整个提示词，不借前缀缓存。
"""

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.utils.device import physical_cores  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
MIXED_LENS = [16, 40, 72, 100, 140, 190, 250, 320]
NANO_PROMPTS = ["introduce yourself", "list all prime numbers within 100"]  # nano-vllm's example
BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"

Run = Callable[[], list[list[int]]]  # one round: the new token ids of every prompt


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown CPU"


def workload(name: str, tokenizer, quick: bool) -> tuple[list[list[int]], SamplingParams]:
    """Prompts as token ids, and the sampling parameters of every request."""
    if name in ("mixed", "loaded"):
        corpus = tokenizer((ROOT / "tools" / "tiny_corpus.txt").read_text())["input_ids"]
        prompts = [corpus[20 * i: 20 * i + n] for i, n in enumerate(MIXED_LENS)]
        return prompts, SamplingParams(max_tokens=4 if quick else 32, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in NANO_PROMPTS * 16]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for c in chats]
    return prompts, SamplingParams(temperature=0.6, max_tokens=4 if quick else 256,
                                   ignore_eos=True)


def ours(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    return lambda: [list(out["token_ids"]) for out in llm.generate(prompts, params)]


def hf_batched(model: torch.nn.Module, pad_id: int, prompts: list[list[int]],
               params: SamplingParams) -> Run:
    """One left-padded batch; sampling like ours: temperature only, no top-k / top-p."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sample = params.temperature > 0
    config = transformers.GenerationConfig(
        max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens, do_sample=sample,
        temperature=params.temperature if sample else None, top_k=0 if sample else None,
        top_p=1.0 if sample else None, eos_token_id=None, pad_token_id=pad_id)

    def run() -> list[list[int]]:
        seq = model.generate(ids, attention_mask=mask, generation_config=config)
        return seq[:, width:].tolist()

    return run


def measure(runs: dict[str, Run], reps: int, warm_up: bool = True) -> tuple[dict[str, list[float]],
                                                                          dict]:
    """One warm-up run each (unless not `warm_up`: a smoke run), then `reps` rounds in turns."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    for i in range(reps + 1 if warm_up else reps):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name] = run()
            if i or not warm_up:
                times[name].append(time.perf_counter() - start)
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description="minisgl LLM.generate against HF generate")
    parser.add_argument("--workload", choices=["mixed", "nano", "loaded"], action="append")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds after one warm-up")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 round of 4 tokens, no warm-up")
    args = parser.parse_args()
    names = args.workload or ["mixed", "nano", "loaded"]
    reps = 1 if args.quick else args.reps
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    llm = LLM(str(MODEL), dtype=torch.float32, cache_type="naive", max_running_req=32)
    threads = torch.get_num_threads()  # the Engine's choice: one per physical core
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    print(f"machine: {cpu_model()}, {physical_cores()} physical cores; {threads} torch threads "
          f"on both sides; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{MODEL.name}, float32; median of {reps} rounds taken in turns"
          + ("" if args.quick else ", after a warm-up"))
    medians: dict[str, dict[str, float]] = {}
    for name in names:
        prompts, params = workload(name, tokenizer, args.quick)
        runs = {"minisgl": ours(llm, prompts, params),
                "HF": hf_batched(model, tokenizer.pad_token_id, prompts, params)}
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if name == "loaded" else None
        try:
            times, tokens = measure(runs, reps, warm_up=not args.quick)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        n_new = len(prompts) * params.max_tokens
        lens = sorted(map(len, prompts))
        kind = "greedy" if params.temperature == 0 else f"temperature {params.temperature}"
        print(f"{name}: {len(prompts)} prompts of {lens[0]}-{lens[-1]} tokens, {kind}, "
              f"{params.max_tokens} new tokens each ({n_new} in all)"
              + (", another process keeping one core busy" if busy else ""))
        medians[name] = {}
        for method, ts in times.items():
            medians[name][method] = statistics.median(ts)
            print(f"  {method:<8} {medians[name][method]:7.2f} s (min {min(ts):.2f} s, "
                  f"max {max(ts):.2f} s), {n_new / medians[name][method]:.1f} tok/s")
        print(f"  HF / minisgl: {medians[name]['HF'] / medians[name]['minisgl']:.2f}x")
        if params.temperature == 0:
            same = sum(a == b for a, b in zip(tokens["minisgl"], tokens["HF"]))
            print(f"  minisgl tokens equal HF's for {same} of {len(prompts)} prompts")
    if "mixed" in medians and "loaded" in medians:
        for method in ("minisgl", "HF"):
            slower = medians["loaded"][method] / medians["mixed"][method]
            print(f"under load, {method} took {slower:.2f}x its unloaded time")
    llm.shutdown()


if __name__ == "__main__":
    main()
