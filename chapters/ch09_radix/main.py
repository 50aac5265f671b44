"""第 9 章的 main：Radix Cache。4 个对话共用同一段 system 提示（用模型的对话模板拼成 token）：radix
缓存只算一次这段前缀，第二次 generate 又全部命中；与不缓存的 naive 比较调度器自己数出的 prefill
token 数，输出与 HF 逐 token 对照。"""

import logging
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.llm import LLM

MODEL = Path("models/SmolLM2-135M-Instruct")
SYSTEM = (
    "You are the assistant of a small bakery. It opens at seven and closes at six, every day "
    "except Monday. It sells sourdough, rye bread, croissants, cinnamon rolls and apple pie, "
    "and a lemon tart on Fridays. Birthday cakes must be ordered three days ahead; delivery is "
    "free within five kilometres. Answer in one short, friendly sentence."
)
QUESTIONS = ["When do you open on Sunday?", "Do you sell rye bread?",
             "Can I order a cake for tomorrow?", "Is delivery free?"]
MORE = ["Which day has the lemon tart?", "Are you open on Mondays?",
        "What pastries do you have?", "When do you close?"]


def chats(tokenizer, questions: list[str]) -> list[list[int]]:
    """The same system message, then one user question each: a long shared prefix."""
    return [tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for q in questions]


def main() -> None:
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: run `python tools/models.py smollm2` in the repository root")
    logging.basicConfig(format="%(message)s", stream=sys.stdout)  # the batch log, in order
    log = logging.getLogger("minisgl.scheduler")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    greedy = SamplingParams(max_tokens=24)  # stops at the end-of-turn token, or after 24
    results = {}
    for cache_type in ("radix", "naive"):
        llm = LLM(str(MODEL), cache_type=cache_type, num_page_override=2048)
        for name, questions in (("first call", QUESTIONS), ("second call", MORE)):
            log.setLevel(logging.DEBUG if cache_type == "radix" else logging.WARNING)
            before = llm.stats.prefill_tokens, llm.stats.cached_tokens
            outputs = llm.generate(chats(tokenizer, questions), greedy)
            computed = llm.stats.prefill_tokens - before[0]
            reused = llm.stats.cached_tokens - before[1]
            print(f"{cache_type} {name}: computed {computed} prompt tokens, "
                  f"took {reused} from the cache")
            results[cache_type, name] = [o["token_ids"] for o in outputs]
        info = llm.cache_manager.prefix_cache.size_info
        print(f"{cache_type}: the cache holds {info.total_size} tokens "
              f"({info.evictable_size} evictable, {info.protected_size} locked)")
        llm.shutdown()
    log.setLevel(logging.WARNING)

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    for name, questions in (("first call", QUESTIONS), ("second call", MORE)):
        for i, ids in enumerate(chats(tokenizer, questions)):
            x = torch.tensor([ids])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24,
                              do_sample=False)[0, x.shape[1]:].tolist()
            ref = ref[:-1] if ref[-1] == tokenizer.eos_token_id else ref  # we leave EOS out
            radix, naive = results["radix", name][i], results["naive", name][i]
            print(f"{questions[i]!r} -> {tokenizer.decode(radix)!r}")
            print(f"  radix == naive: {radix == naive}, == HF: {radix == ref}")


if __name__ == "__main__":
    main()
