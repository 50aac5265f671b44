"""第 11 章示例：CPU 上同样三个提示词、各生成 16 个 token，我们的 LLM.generate 与 HF transformers
的 generate（逐个提示词，以及左填充成一批）谁快。SmolLM2-135M-Instruct，float32，贪心。

    python examples/ch11_speed.py            # 预热 2 轮，再计时 20 轮
    python examples/ch11_speed.py --reps 40
    python examples/ch11_speed.py --quick    # 冒烟测试：不预热，1 轮，每个提示词 4 个 token

三种做法轮流执行（我们、HF 逐个、HF 成批、我们、……），两边用同样的 torch 线程数；每种做法取
各轮耗时的中位数（另给最小、最大值）。我们这边用 cache_type="naive"，每轮都重新计算整个提示词，
和 HF 一样不借前一轮的前缀缓存。最后核对我们的 token 与 HF 逐个生成的是否逐一相同。
"""

import argparse
import os
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
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]
NEW_TOKENS = 16
WARMUP = 2

Run = Callable[[], list[list[int]]]  # one round: the new token ids of every prompt


def cpu_model() -> str:
    """The "model name" line of /proc/cpuinfo, or "unknown CPU"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return "unknown CPU"


def ours_run(llm: LLM) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return lambda: [list(out["token_ids"]) for out in llm.generate(PROMPTS, params)]


def hf_one_by_one(model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase) -> Run:
    prompts = [torch.tensor([tokenizer(p)["input_ids"]]) for p in PROMPTS]

    def run() -> list[list[int]]:
        outs = []
        for ids in prompts:  # an explicit mask: HF would otherwise hide prompt tokens = pad id
            seq = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(seq[0, ids.shape[1]:].tolist())
        return outs

    return run


def hf_batched(model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase) -> Run:
    tokenizer.padding_side = "left"  # new tokens go right after every prompt's last token
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    width = batch["input_ids"].shape[1]

    def run() -> list[list[int]]:
        seq = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        return seq[:, width:].tolist()

    return run


def first_difference(a: list[int], b: list[int]) -> str:
    if a == b:
        return "same"
    if len(a) != len(b):
        return f"lengths {len(a)} and {len(b)}"
    return f"differ from token {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)} on"


def main() -> None:
    parser = argparse.ArgumentParser(description="minisgl LLM.generate against HF generate")
    parser.add_argument("--reps", type=int, default=20, help="timed rounds (after 2 warm-up)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 round of 4 tokens")
    args = parser.parse_args()
    if args.quick:  # what `tools/steps.py check` runs: the same code, in seconds
        global WARMUP, NEW_TOKENS
        WARMUP, NEW_TOKENS, args.reps = 0, 4, 1
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    os.environ.pop("OMP_NUM_THREADS", None)  # the Engine picks one thread per physical core
    llm = LLM(str(MODEL), dtype=torch.float32, cache_type="naive")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # one process: HF runs with the very same setting
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop early: all 16 tokens, as ours
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    print(f"machine: {cpu_model()}, {physical_cores()} physical cores; {threads} torch threads "
          f"on both sides; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{MODEL.name}, float32, greedy; {len(PROMPTS)} prompts, {NEW_TOKENS} new tokens each")

    runs = {
        "minisgl LLM.generate, 3 prompts in one call": ours_run(llm),
        "HF generate, one prompt at a time": hf_one_by_one(model, tokenizer),
        "HF generate, 3 prompts left-padded": hf_batched(model, tokenizer),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[list[int]]] = {}
    for i in range(WARMUP + args.reps):  # in turns: every method sees the same machine state
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name] = run()
            elapsed = time.perf_counter() - start
            if i >= WARMUP:
                times[name].append(elapsed)

    n_new = len(PROMPTS) * NEW_TOKENS
    print(f"time of one round ({n_new} new tokens), median of {args.reps} rounds "
          f"after {WARMUP} warm-up rounds:")
    medians = {}
    for name, ts in times.items():
        medians[name] = statistics.median(ts)
        print(f"  {name:<44}  {medians[name]:.2f} s (min {min(ts):.2f} s, max {max(ts):.2f} s),"
              f" {n_new / medians[name]:.1f} tok/s")
    ours, one, batched = medians.values()
    print(f"HF one prompt at a time / minisgl: {one / ours:.2f}x")
    print(f"HF left-padded batch / minisgl:    {batched / ours:.2f}x")

    ours_tokens, one_tokens, batched_tokens = tokens.values()
    same = sum(a == b for a, b in zip(ours_tokens, one_tokens))
    print(f"minisgl tokens equal HF one-at-a-time tokens for {same} of {len(PROMPTS)} prompts")
    for prompt, a, b, c in zip(PROMPTS, ours_tokens, one_tokens, batched_tokens):
        print(f"  {prompt!r}: HF one at a time {first_difference(a, b)}, "
              f"HF batched {first_difference(a, c)}")
    llm.shutdown()


if __name__ == "__main__":
    main()
