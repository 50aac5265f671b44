"""第 2 章的 main：用算子层拼出的网络，两个请求一批生成，与 HF 对照。"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.core import Context, set_global_ctx

from skeleton import LayeredModel, generate

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def main() -> None:
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: run `python tools/models.py smollm2` in the repository root")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    set_global_ctx(Context(page_size=1))
    outputs = generate(LayeredModel(MODEL), prompts, max_tokens=16)

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for text, ids, ours in zip(PROMPTS, prompts, outputs):
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                          do_sample=False)[0, len(ids):].tolist()
        print(f"{text!r} ({len(ids)} tokens) -> {tokenizer.decode(ours)!r}")
        print(f"  same 16 tokens as HF: {ours == ref}, distinct ids: {len(set(ours))}")


if __name__ == "__main__":
    main()
