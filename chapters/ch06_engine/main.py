"""第 6 章的 main：Engine 加手工拼的 batch，4 个长短不同的请求一批生成，与单独运行、与 HF 对照。"""

import sys
from pathlib import Path

import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig

sys.path.insert(0, "tests")  # the HF reference every test aligns to
from reference import hf_greedy, hf_tokenizer, require_model
from skeleton import HandBatcher

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Once upon a time, in a small village by the sea, there lived",
]


def main() -> None:
    tokenizer = hf_tokenizer(require_model(MODEL))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)

    engine = Engine(EngineConfig(str(MODEL), dtype=torch.float32, max_running_req=8,
                                 num_page_override=512))
    print(f"engine: device {engine.device}, {engine.num_threads} threads, "
          f"{engine.num_pages} KV pages, backend {type(engine.attn_backend).__name__}")
    together = HandBatcher(engine).generate(prompts, greedy)
    alone = [HandBatcher(engine).generate([p], greedy)[0] for p in prompts]
    engine.shutdown()
    for text, ids, batched, solo in zip(PROMPTS, prompts, together, alone):
        ref, _ = hf_greedy(MODEL, ids, 16)
        print(f"{text!r} ({len(ids)} tokens) -> {tokenizer.decode(batched)!r}")
        print(f"  batch == alone: {batched == solo}, batch == HF: {batched == ref}, "
              f"distinct ids: {len(set(batched))}")


if __name__ == "__main__":
    main()
