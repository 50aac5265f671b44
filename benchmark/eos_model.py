"""A copy of a random-weight model folder whose EOS token is one the model does emit (chapter 22).

    python benchmark/eos_model.py --model /tmp/q06 --out /tmp/q06eos --requests 256 \\
        --input-len 100 1024 --output-len 512 1024

Random weights almost never produce the tokenizer's own EOS, so every request runs to its
max_tokens, and admission by expected need has nothing to gain. Here our engine generates, greedy,
`--probe` tokens for the first `--requests` prompts of bench_offline's nano-vllm draw (the same
arguments give the same prompts), and picks, of the tokens that end the most of those outputs
(within 90% of the most), the one whose first appearance has the median closest to `--target`;
outputs without it run to their max_tokens.
The new folder links the weights and changes only the tokenizer's `eos_token`: both engines read
the EOS from the tokenizer, so both stop there. Prints the chosen token and where each request
would stop (so a run can say how far below max_tokens the outputs end).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

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


def choose(outputs: list[list[int]], target: int) -> tuple[int, list[int]]:
    """The token that ends the most outputs (first appearing after position 0; never first in
    an output, which would end it empty), the median of its first positions closest to `target`
    among equals."""
    found = {t: ps for t, ps in first_positions(outputs).items() if min(ps) > 0}
    if not found:
        raise SystemExit("every token that appears starts some output: probe more (--probe)")
    most = max(map(len, found.values()))
    near = [t for t, ps in found.items() if len(ps) >= 0.9 * most]
    token = min(sorted(near), key=lambda t: abs(statistics.median(found[t]) - target))
    return token, found[token]


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
    args = parser.parse_args()
    prompts, _ = workload(args.requests, tuple(args.input_len), tuple(args.output_len),
                          args.max_id)
    llm = LLM(args.model)
    try:
        out = llm.generate(prompts, SamplingParams(max_tokens=args.probe, ignore_eos=True))
        tokenizer = llm.tokenizer
    finally:
        llm.shutdown()
    outputs = [list(o["token_ids"]) for o in out]  # type: ignore[arg-type]
    token, positions = choose(outputs, args.target)
    text = tokenizer.convert_ids_to_tokens(token)
    src, dst = Path(args.model), Path(args.out)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():  # weights and configs linked, the tokenizer's settings copied
        if f.name not in ("tokenizer_config.json", "special_tokens_map.json"):
            (dst / f.name).symlink_to(f.resolve())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            data = json.loads((src / name).read_text())
            data["eos_token"] = text
            (dst / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    stops = sorted(positions)
    q = statistics.quantiles(stops, n=10)
    print(f"EOS is now token {token} ({text!r}); it appears in {len(stops)} of {len(outputs)} "
          f"outputs of {args.probe} greedy tokens; first at positions p10 {q[0]:.0f}, p50 "
          f"{statistics.median(stops):.0f}, p90 {q[-1]:.0f} (those requests stop there); "
          f"wrote {dst}")


if __name__ == "__main__":
    main()
