"""第 0 章的 main：朴素引擎在 SmolLM2 上贪心生成 16 个 token，与 HF 逐 token 对照。"""

import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from naive import NaiveEngine

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]
NEW_TOKENS = 16


def main() -> None:
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: run `python tools/models.py smollm2` in the repository root")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    engine = NaiveEngine(MODEL)  # float32: the same precision as the reference
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # 16 tokens on both sides, EOS or not
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        start = time.perf_counter()
        ours, logits = engine.generate(ids, NEW_TOKENS)
        elapsed = time.perf_counter() - start
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(ids):].tolist()
        worst = max(float((a - b[0]).abs().max()) for a, b in zip(logits, out.logits))
        print(f"prompt: {prompt!r} ({len(ids)} tokens)")
        print(f"  naive: {tokenizer.decode(ours)!r}")
        print(f"  HF   : {tokenizer.decode(ref)!r}")
        print(f"  same {NEW_TOKENS} tokens: {ours == ref}, distinct ids: {len(set(ours))}, "
              f"max |Δlogit| <= 1e-3 at every step: {worst <= 1e-3}, naive time {elapsed:.2f} s")


if __name__ == "__main__":
    main()
