"""第 0 章示例（先看结果）：用全书做完的引擎 minisgl 一次生成三个提示词的续写。

    python examples/ch00_quickstart.py
    python examples/ch00_quickstart.py --max-tokens 32

CPU 即可，float32，贪心解码，忽略 EOS（每个提示词都正好生成 --max-tokens 个 token）。
模型不存在时先调用 tools/models.py smollm2 制作（约 40 秒，需要能用 pip 下载）。
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]


def main() -> None:
    parser = argparse.ArgumentParser(description="minisgl's offline LLM on three prompts")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        if args.model.name != "SmolLM2-135M-Instruct":
            sys.exit(f"{args.model} has no config.json; pass --model with a HF model folder")
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    llm = LLM(str(args.model))  # dtype None: float32 on the CPU, bfloat16 on a GPU
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)  # one call: the three requests share every batch
    elapsed = time.perf_counter() - start
    for prompt, out in zip(PROMPTS, outputs):
        print(f"{prompt!r} -> {out['text']!r}")
    new_tokens = sum(len(out["token_ids"]) for out in outputs)
    print(f"{len(PROMPTS)} prompts, {new_tokens} new tokens in {elapsed:.2f} s "
          f"({new_tokens / elapsed:.1f} tok/s)")
    llm.shutdown()


if __name__ == "__main__":
    main()
