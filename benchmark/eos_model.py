"""A copy of a random-weight model folder whose EOS token ends about half the outputs early
(chapter 22).

    python benchmark/eos_model.py --model /tmp/q06 --out /tmp/q06eos --requests 256 \\
        --input-len 100 1024 --output-len 512 1024

Random weights almost never produce the tokenizer's own EOS, so every request runs to its
max_tokens, and admission by expected need has nothing to gain. Here our engine generates, greedy,
`--probe` tokens for the first `--requests` prompts of bench_offline's nano-vllm draw (the same
arguments give the same prompts) and picks, of the tokens above `--max-id` (never in a prompt)
that end the most of those outputs, the one whose first appearance has the median closest to
`--target`. Greedy outputs of random weights fall into loops of their own, so that token alone
ends few of them. Its row of the LM head is then scaled by a factor found by bisection (the same
outputs generated again for each factor) until the median over all outputs of where it first
appears, counting outputs without it as never, is nearest `--target`: a larger row makes the
token win sooner, and until it wins an output is unchanged, so each output's stop only moves
earlier as the factor grows (to the first token: some outputs may then end empty). The first
`--requests` prompts of a larger draw are the same prompts, so a probe of fewer requests than
the benchmark runs stands for it.
The new folder links the other files, rewrites the weights file that holds that row (with tied
embeddings, the embedding row: the token is never an input before it ends its request) and
changes the tokenizer's `eos_token`: both engines read the weights and take the EOS from the
tokenizer, so both stop there. Prints the chosen token, the factor and where the outputs of the
probe stop.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "benchmark")]

from bench_offline import workload  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402


def first_positions(outputs: list[list[int]]) -> dict[int, list[int]]:
    """token -> the index of its first appearance in each output that has it."""
    found: dict[int, list[int]] = {}
    for out in outputs:
        seen: set[int] = set()
        for i, token in enumerate(out):
            if token not in seen:
                seen.add(token)
                found.setdefault(token, []).append(i)
    return found


def choose(outputs: list[list[int]], target: int, low: int = 0,
           high: int | None = None) -> tuple[int, list[int]]:
    """The token in [`low`, `high`) that ends the most outputs (first appearing after position 0;
    never first in an output, which would end it empty), the median of its first positions
    closest to `target` among equals."""
    found = {t: ps for t, ps in first_positions(outputs).items()
             if low <= t < (high or t + 1) and min(ps) > 0}
    if not found:
        raise SystemExit(f"every token in [{low}, {high}) that appears starts some output, or "
                         "none appears: probe more (--probe)")
    most = max(map(len, found.values()))
    near = [t for t, ps in found.items() if len(ps) >= 0.9 * most]
    token = min(sorted(near), key=lambda t: abs(statistics.median(found[t]) - target))
    return token, found[token]


def stops(outputs: list[list[int]], token: int) -> list[float]:
    """Where `token` first appears in each output; inf where it does not."""
    return [float(out.index(token)) if token in out else float("inf") for out in outputs]


def scaled(row: torch.Tensor, factor: float) -> torch.Tensor:
    """`row` times `factor`, rounded to its dtype: the same bits in the engine and the file."""
    return (row.float() * factor).to(row.dtype)


def head_key(model: Path) -> str:
    """The weight whose rows are the logits' (the embedding when the head is tied)."""
    config = json.loads((model / "config.json").read_text())
    return "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"


def bisect(measure: Callable[[float], float], target: int, steps: int,
           top: float = 4096.0) -> tuple[float, float]:
    """The factor in [1, `top`] whose median stop (`measure(factor)`) is nearest `target`, from
    doubling until the median is at or below `target`, then `steps` halvings: (factor, median).
    The median never rises as the factor grows."""
    tried = {1.0: measure(1.0)}
    lo, hi = 1.0, 1.0
    while tried[hi] > target and hi < top:
        lo, hi = hi, hi * 2
        tried[hi] = measure(hi)
    for _ in range(steps if tried[hi] <= target < tried[lo] else 0):
        mid = (lo + hi) / 2
        tried[mid] = measure(mid)
        lo, hi = (mid, hi) if tried[mid] > target else (lo, mid)
    return min(tried.items(), key=lambda kv: (abs(kv[1] - target), kv[0]))


def write_folder(src: Path, dst: Path, token: int, text: str, factor: float) -> None:
    """Link `src`'s files into `dst`, but rewrite the weights file that holds the head row and
    the tokenizer's settings."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    key = head_key(src)

    def holds(f: Path) -> bool:
        with safe_open(str(f), "pt") as opened:
            return key in opened.keys()

    holder = next((f for f in sorted(src.glob("*.safetensors")) if holds(f)), None)
    if holder is None:
        raise SystemExit(f"no *.safetensors file in {src} holds {key}")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    mine = ("tokenizer_config.json", "special_tokens_map.json", holder.name)
    for f in src.iterdir():
        if f.name not in mine:
            (dst / f.name).symlink_to(f.resolve())
    tensors = load_file(str(holder))
    tensors[key][token] = scaled(tensors[key][token], factor)
    save_file(tensors, str(dst / holder.name), metadata={"format": "pt"})
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            data = json.loads((src / name).read_text())
            data["eos_token"] = text
            (dst / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    parser.add_argument("--output-len", type=int, nargs=2, default=[512, 1024])
    parser.add_argument("--max-id", type=int, default=10000)
    parser.add_argument("--probe", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--target", type=int, default=96, help="median stop position sought")
    parser.add_argument("--steps", type=int, default=6, help="bisection steps for the factor")
    args = parser.parse_args()
    prompts, _ = workload(args.requests, tuple(args.input_len), tuple(args.output_len),
                          args.max_id)
    src, dst = Path(args.model), Path(args.out)
    llm = LLM(args.model)
    try:
        params = SamplingParams(max_tokens=args.probe, ignore_eos=True)

        def generate() -> list[list[int]]:
            return [list(o["token_ids"]) for o in llm.generate(prompts, params)]  # type: ignore[arg-type]

        unscaled = generate()
        token, _ = choose(unscaled, args.target, low=args.max_id + 1,
                          high=len(llm.tokenizer))  # ids past the tokenizer's have no text
        model = llm.engine.model
        tied = head_key(src).startswith("model.")
        weight = model.model.embed_tokens.weight if tied else model.lm_head.weight
        row = weight[token].clone()
        seen: dict[float, list[float]] = {1.0: stops(unscaled, token)}  # no second probe

        def measure(factor: float) -> float:
            if factor in seen:
                return statistics.median(seen[factor])
            with torch.no_grad():
                weight[token] = scaled(row, factor)
            seen[factor] = stops(generate(), token)
            return statistics.median(seen[factor])

        factor, _ = bisect(measure, args.target, args.steps)
        text = llm.tokenizer.convert_ids_to_tokens(token)
    finally:
        llm.shutdown()
    write_folder(src, dst, token, text, factor)
    ended = sorted(s for s in seen[factor] if s != float("inf"))
    if not ended:
        raise SystemExit(f"token {token} ends no output even scaled by {factor:g}")
    q = statistics.quantiles(ended, n=10, method="inclusive") if len(ended) > 1 else ended * 9
    print(f"EOS is now token {token} ({text!r}), its LM-head row scaled by {factor:g} (tried "
          f"{len(seen)} factors); it ends {len(ended)} of {len(prompts)} outputs of "
          f"{args.probe} greedy tokens, first at positions p10 {q[0]:.0f}, p50 "
          f"{statistics.median(ended):.0f}, p90 {q[-1]:.0f} (those requests stop there; the "
          f"others run to max_tokens); wrote {dst}")


if __name__ == "__main__":
    main()
