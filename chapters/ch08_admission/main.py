"""第 8 章的 main：准入控制。过长的提示词在开始前被拒绝；max_tokens 超出剩余长度时被截短；
KV 池只够放下一部分请求时，其余请求排队等待，结果仍与 HF 逐 token 相同。"""

import logging
import sys
from pathlib import Path

from minisgl.core import SamplingParams
from minisgl.llm import LLM

sys.path.insert(0, "tests")  # the HF reference every test aligns to
from reference import hf_greedy, require_model

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "Water boils at",
]


def main() -> None:
    require_model(MODEL)
    logging.basicConfig(format="%(message)s", stream=sys.stdout)  # the batch log, in order
    log = logging.getLogger("minisgl.scheduler")

    # 1. lengths: max_seq_len 48 for this demonstration
    llm = LLM(str(MODEL), max_seq_len_override=48, num_page_override=64)
    try:
        llm.generate(["hello"] * 2 + ["word " * 60], SamplingParams(max_tokens=4))
    except ValueError as e:
        print(f"ValueError: {e}")
    log.setLevel(logging.INFO)  # shows the clipping
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    print(f"max_tokens 100 -> {len(out['token_ids'])} tokens generated")
    llm.shutdown()

    # 2. a KV pool of 20 pages of 4 tokens: each request needs up to 8 of them
    log.setLevel(logging.DEBUG)
    llm = LLM(str(MODEL), page_size=4, num_page_override=20, max_running_req=8)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy)
    print(f"stats: {llm.stats}")
    tokenizer = llm.tokenizer
    llm.shutdown()
    log.setLevel(logging.WARNING)
    for uid, (text, out) in enumerate(zip(PROMPTS, outputs)):
        ids = tokenizer.encode(text)
        ref, _ = hf_greedy(MODEL, ids, 16)
        print(f"uid {uid} ({len(ids)} prompt tokens): same as HF: {out['token_ids'] == ref}")


if __name__ == "__main__":
    main()
