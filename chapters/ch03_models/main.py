"""第 3 章的 main：按 architectures[0] 从注册表建模型、加载权重，五个模型逐一与 HF 对照。"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.core import Context, set_global_ctx
from minisgl.models import ModelConfig, load_hf_config

from skeleton import generate, install_naive_attention, load_model

MODELS = ["SmolLM2-135M-Instruct", "tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def main() -> None:
    for name in MODELS:
        path = Path("models") / name
        if not (path / "config.json").is_file():
            sys.exit(f"{path} is missing: run `python tools/models.py tiny` and "
                     "`python tools/models.py smollm2` in the repository root")
        config = ModelConfig.from_hf(load_hf_config(path))
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
        set_global_ctx(Context(page_size=1))
        install_naive_attention()
        ours = generate(load_model(path), prompts, max_tokens=16)
        set_global_ctx(None)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        same = []
        for ids, out in zip(prompts, ours):
            x = torch.tensor([ids])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                              do_sample=False)[0, len(ids):].tolist()
            same.append(out == ref)
        print(f"{name}: {config.architecture}, {config.num_layers} layers, "
              f"{config.num_qo_heads}/{config.num_kv_heads} heads of {config.head_dim}, "
              f"tied={config.tie_word_embeddings}; same 16 tokens as HF: {same}")
        print(f"  {PROMPTS[0]!r} -> {tokenizer.decode(ours[0])!r}")


if __name__ == "__main__":
    main()
