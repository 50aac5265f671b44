"""第 2 章的 main：用算子层拼出的网络，两个请求一批生成，与 HF 对照。"""

import sys
from pathlib import Path

from minisgl.core import Context, set_global_ctx

sys.path.insert(0, "tests")  # the HF reference every test aligns to
from reference import hf_greedy, hf_tokenizer, require_model
from skeleton import LayeredModel, generate

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def main() -> None:
    tokenizer = hf_tokenizer(require_model(MODEL))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    set_global_ctx(Context(page_size=1))
    outputs = generate(LayeredModel(MODEL), prompts, max_tokens=16)
    for text, ids, ours in zip(PROMPTS, prompts, outputs):
        ref, _ = hf_greedy(MODEL, ids, 16)
        print(f"{text!r} ({len(ids)} tokens) -> {tokenizer.decode(ours)!r}")
        print(f"  same 16 tokens as HF: {ours == ref}, distinct ids: {len(set(ours))}")


if __name__ == "__main__":
    main()
