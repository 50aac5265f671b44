"""第 22 章的 main：同一批 16 个问题（max_tokens 是实际回答长度的好几倍）在同一个小 KV 池上
跑三次：按 max_tokens 全额预留（第 8 章），按期望需求准入（默认的比例），再把期望压得很低，
逼出回收。每一次都数 decode 步数、一步里同时运行的请求、回收与重算；三次的输出逐 token
相同，也与 HF 逐个生成的相同。"""

import logging
import sys
from pathlib import Path

from minisgl.core import SamplingParams
from minisgl.llm import LLM

sys.path.insert(0, "tests")  # the HF reference every test aligns to
from reference import hf_greedy, hf_tokenizer, require_model

MODEL = Path("models/SmolLM2-135M-Instruct")
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
    "What color is the sky?", "Who wrote Hamlet?", "What is the boiling point of water?",
    "Name a fruit that is yellow.", "How many days are in a week?", "Translate 'cat' to French.",
    "What is the capital of Japan?", "Name a planet in our solar system.",
    "What is the freezing point of water?", "How many hours are in a day?", "What is H2O?",
    "Who painted the Mona Lisa?", "What is the square root of 9?",
]
MAX_TOKENS = 128  # what a client asks for; the answers end (EOS) after 7 to 88 tokens
POOL = 400  # KV tokens (page size 1): two requests' prompts and all of max_tokens
RUNS = [("conservative", 1.0), ("expected", 1.0), ("expected", 0.1)]


class BatchLog(logging.Handler):
    """Keeps the size of every decode batch and the retraction lines the scheduler logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.decode_sizes: list[int] = []
        self.retractions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("decode"):
            self.decode_sizes.append(len(message.split()) - 1)
        elif "retracted" in message:
            self.retractions.append(message)


def main() -> None:
    tokenizer = hf_tokenizer(require_model(MODEL))
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                       add_generation_prompt=True, tokenize=False)
                         )["input_ids"] for q in QUESTIONS]
    scheduler_log = logging.getLogger("minisgl.scheduler")
    scheduler_log.setLevel(logging.DEBUG)
    print(f"{len(prompts)} requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))}"
          f" tokens, max_tokens {MAX_TOKENS}, a pool of {POOL} KV tokens\n")
    print(f"{'admission':<13} {'conserv.':>8} {'decode steps':>12} {'running mean':>12} "
          f"{'max':>4} {'ratio starts':>12} {'retractions':>11} {'requests':>8} {'recomputed':>10}")
    outputs = []
    for mode, conservativeness in RUNS:
        log = BatchLog()
        scheduler_log.addHandler(log)
        llm = LLM(str(MODEL), num_page_override=POOL, admission=mode,
                  schedule_conservativeness=conservativeness)
        start = llm.new_token_ratio  # it decays as decode steps go by, and is back when idle
        try:
            result = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
            stats = llm.stats
        finally:
            llm.shutdown()
            scheduler_log.removeHandler(log)
        outputs.append([list(r["token_ids"]) for r in result])
        sizes = log.decode_sizes
        print(f"{mode:<13} {conservativeness:>8} {len(sizes):>12} {sum(sizes) / len(sizes):>12.2f} "
              f"{max(sizes):>4} {start:>12.2f} {stats.retractions:>11} {stats.retracted_reqs:>8} "
              f"{stats.recomputed_tokens:>10}")
        for line in log.retractions[:2]:
            print(f"  log: {line}")

    lengths = [len(o) for o in outputs[0]]
    print(f"\noutput lengths: {lengths} (sum {sum(lengths)})")
    print(f"the three runs give the same tokens: {outputs[0] == outputs[1] == outputs[2]}")
    same = [hf_greedy(MODEL, p, len(o) + 1)[0][: len(o)] == o for p, o in zip(prompts, outputs[0])]
    print(f"same as HF, request by request: {sum(same)} of {len(same)}")


if __name__ == "__main__":
    main()
