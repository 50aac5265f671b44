"""第 7 章的 main：调度器接管手工 batch。6 个请求、最多 3 个同时运行，请求在步与步之间加入和离开；
每个请求的输出与 HF 单独生成的逐 token 对照。"""

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
MAX_TOKENS = [12, 4, 8, 16, 6, 10]  # different lengths: requests leave at different steps


def main() -> None:
    require_model(MODEL)
    # the scheduler logs every batch it builds: phase, then uid+new tokens of each request
    logging.basicConfig(format="%(message)s", stream=sys.stdout)  # the batch log, in order
    logging.getLogger("minisgl.scheduler").setLevel(logging.DEBUG)

    llm = LLM(str(MODEL), max_running_req=3, num_page_override=512)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    print(f"stats: {llm.stats}")
    tokenizer = llm.tokenizer
    llm.shutdown()
    for uid, (text, out, n) in enumerate(zip(PROMPTS, outputs, MAX_TOKENS)):
        ref, _ = hf_greedy(MODEL, tokenizer.encode(text), n)
        print(f"uid {uid}: {text!r} -> {out['text']!r}")
        print(f"  {len(out['token_ids'])} tokens, same as HF: {out['token_ids'] == ref}")


if __name__ == "__main__":
    main()
