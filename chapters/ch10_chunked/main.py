"""第 10 章的 main：分块 prefill。一个长提示词和两个短提示词，每批 prefill 最多算 48 个 token：
长提示词被切成几块、跨几步算完，短请求在预算有余时搭车；结果与不分块、与 HF 逐 token 相同。"""

import logging
import sys
from pathlib import Path

from minisgl.core import SamplingParams
from minisgl.llm import LLM

sys.path.insert(0, "tests")  # the HF reference every test aligns to
from reference import hf_greedy, require_model

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = [
    "The history of bread begins in the Neolithic, when people first ground wild grains "
    "between stones and baked the paste on hot rocks. Leavened bread came later: a dough left "
    "out long enough caught wild yeasts from the air, rose, and baked into something lighter. "
    "The Egyptians made this a craft, with ovens, bakers and dozens of kinds of loaves. In "
    "short, the three most important steps in the history of bread were",
    "The capital of France is",
    "def fibonacci(n):",
]


def main() -> None:
    require_model(MODEL)
    logging.basicConfig(format="%(message)s", stream=sys.stdout)  # the batch log, in order
    log = logging.getLogger("minisgl.scheduler")
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    results = {}
    for budget in (48, 8192):
        log.setLevel(logging.DEBUG if budget == 48 else logging.WARNING)
        llm = LLM(str(MODEL), max_extend_tokens=budget, num_page_override=1024)
        results[budget] = [o["token_ids"] for o in llm.generate(PROMPTS, greedy)]
        print(f"max_extend_tokens {budget}: {llm.stats.prefill_batches} prefill batches, "
              f"{llm.stats.prefill_tokens} prompt tokens computed")
        tokenizer = llm.tokenizer
        llm.shutdown()
    log.setLevel(logging.WARNING)
    for text, chunked, whole in zip(PROMPTS, results[48], results[8192]):
        ids = tokenizer.encode(text)
        ref, _ = hf_greedy(MODEL, ids, 12)
        print(f"{len(ids)} prompt tokens -> {tokenizer.decode(chunked)!r}")
        print(f"  chunked == whole: {chunked == whole}, == HF: {chunked == ref}")


if __name__ == "__main__":
    main()
