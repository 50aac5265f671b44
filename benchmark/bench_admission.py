"""Chapter 22 on the CPU: admission by all of max_tokens (conservative) against admission by
expected need, on one workload, rounds taken in turns.

    python benchmark/bench_admission.py            # 64 requests, 3 rounds of each (a few minutes)
    python benchmark/bench_admission.py --quick    # smoke test: 4 requests, 1 call; not figures

SmolLM2-135M-Instruct, float32, greedy, the model's EOS ends a request. 64 one-line chat
questions (capitals, sums, translations, "name a ...") whose answers end after a few to about a
hundred tokens, asked with max_tokens 192, several times what they use, as clients do. All 64
arrive at once (LLM.generate); the KV pool holds 1,850 tokens, room for 8 requests' prompts and
all of their max_tokens. TTFT: from the call to each request's first token. Output tok/s: the
tokens of every answer over the wall time of the call. Running per step: requests in each
decode batch, read from the scheduler's batch log. Both settings in one process, one warm-up
call each, then rounds in turns; medians with their range.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "examples")]

import torch  # noqa: E402
from ch11_speed import cpu_model  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.scheduler.utils import TokenReply  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
COUNTRIES = ["France", "Japan", "Italy", "Spain", "Germany", "Canada", "Egypt", "Brazil",
             "India", "Kenya", "Peru", "Norway", "Greece", "Mexico", "China", "Chile"]
WORDS = ["cat", "dog", "house", "water", "bread", "sun", "book", "tree",
         "apple", "car", "moon", "friend", "school", "city", "rain", "music"]
THINGS = ["fruit that is red", "animal that can fly", "color of the rainbow", "musical instrument",
          "planet in our solar system", "vegetable that is green", "ocean on Earth",
          "famous scientist", "bird that cannot fly", "metal", "flower",
          "mammal that lives in the sea", "sport played with a ball", "language spoken in Europe",
          "month with 31 days", "shape with four sides"]
MAX_TOKENS = 192
POOL = 1850  # KV tokens, page size 1
SETTINGS = {"conservative": {"admission": "conservative"}, "expected": {"admission": "expected"}}


def questions() -> list[str]:
    return ([f"What is the capital of {c}?" for c in COUNTRIES]
            + [f"What is {a} + {b}?" for a, b in zip(range(2, 18), range(7, 23))]
            + [f"Translate '{w}' to French." for w in WORDS]
            + [f"Name a {t}." for t in THINGS])


class TimedLLM(LLM):
    """An LLM that notes when each request's first token comes back."""

    first: dict[int, float]

    def send_result(self, replies: list[TokenReply]) -> None:
        now = time.perf_counter()
        for r in replies:
            self.first.setdefault(r.uid, now)
        super().send_result(replies)


class DecodeSizes(logging.Handler):
    """The number of requests in every decode batch the scheduler logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sizes: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("decode"):
            self.sizes.append(len(message.split()) - 1)


def one_call(config: dict[str, str], prompts: list[list[int]], log: DecodeSizes) -> dict:
    """A fresh LLM (made and shut down outside the timed window), one timed generate call."""
    llm = TimedLLM(str(MODEL), dtype=torch.float32, num_page_override=POOL, **config)
    try:
        llm.first, log.sizes = {}, []
        start = time.perf_counter()
        out = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    ttft = sorted(t - start for t in llm.first.values())
    s = llm.stats
    tokens = sum(len(o["token_ids"]) for o in out)
    return {"wall_s": wall, "out_tok_s": tokens / wall, "output_tokens": tokens,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "decode_steps": len(log.sizes), "running_mean": sum(log.sizes) / len(log.sizes),
            "running_max": max(log.sizes), "prefill_batches": s.prefill_batches,
            "retractions": s.retractions, "retracted_reqs": s.retracted_reqs,
            "recomputed_tokens": s.recomputed_tokens,
            "outputs": [list(o["token_ids"]) for o in out]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each setting")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 4 requests, one call of each; not figures to publish")
    args = parser.parse_args()
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL.relative_to(ROOT)} is missing: python tools/models.py smollm2")
    qs = questions()[:: 16 if args.quick else 1]
    rounds = 0 if args.quick else args.rounds

    log = DecodeSizes()
    logging.getLogger("minisgl.scheduler").addHandler(log)
    logging.getLogger("minisgl.scheduler").setLevel(logging.DEBUG)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False))
        for q in qs]
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; date "
          f"{datetime.date.today().isoformat()}")
    print(f"{MODEL.name}, float32, greedy; {len(prompts)} chat questions (prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens) at once, max_tokens "
          f"{MAX_TOKENS}; a KV pool of {POOL} tokens (page size 1); radix cache")
    if args.quick:
        print("QUICK: a smoke test; not figures to publish")
    load = os.getloadavg()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tqdm(total=(rounds + 1) * len(SETTINGS), desc="calls", file=sys.stderr,
              leave=False) as bar:
        for r in range(rounds + 1):  # round 0 warms up and is kept only by --quick
            for name, config in SETTINGS.items():
                got = one_call(config, prompts, log)
                if r or args.quick:
                    results[name].append(got)
                bar.update(1)

    lengths = [len(o) for o in results["conservative"][0]["outputs"]]
    same = all(x["outputs"] == results["conservative"][0]["outputs"]
               for runs in results.values() for x in runs)
    mean = statistics.mean(lengths)
    print(f"answers: {sum(lengths)} tokens, {min(lengths)}-{max(lengths)} each (mean "
          f"{mean:.1f}; max_tokens is {MAX_TOKENS / mean:.1f}x that); every call gave the same "
          f"tokens: {same}")
    print(f"load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load)}; at end: "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"medians of {len(results['expected'])} round(s) taken in turns (min-max):")
    rows = [("output tok/s", "out_tok_s", "{:.1f}"), ("wall s", "wall_s", "{:.2f}"),
            ("TTFT p50 s", "ttft_p50_s", "{:.2f}"), ("TTFT p99 s", "ttft_p99_s", "{:.2f}"),
            ("decode steps", "decode_steps", "{:.0f}"),
            ("running per decode step", "running_mean", "{:.2f}"),
            ("most running at once", "running_max", "{:.0f}"),
            ("prefill batches", "prefill_batches", "{:.0f}"),
            ("retractions", "retractions", "{:.0f}"),
            ("requests retracted", "retracted_reqs", "{:.0f}"),
            ("tokens recomputed", "recomputed_tokens", "{:.0f}")]
    print(f"  {'':<24}" + "".join(f"{name:>24}" for name in results))
    for label, key, fmt in rows:
        cells = []
        for runs in results.values():
            values = [x[key] for x in runs]
            cell = fmt.format(statistics.median(values))
            if min(values) != max(values):
                cell += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
            cells.append(cell)
        print(f"  {label:<24}" + "".join(f"{c:>24}" for c in cells))
    ratios = [e["out_tok_s"] / c["out_tok_s"]
              for e, c in zip(results["expected"], results["conservative"])]
    print(f"expected / conservative output tok/s, per round: "
          f"{' '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
