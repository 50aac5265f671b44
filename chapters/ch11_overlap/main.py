"""第 11 章的 main，也是第二阶段的里程碑：一次 generate 里 8 个请求共用一段很长的前缀（同一段 system
提示），后缀各不相同。radix 缓存算的 prefill token 不超过 naive 的四分之一（调度器自己数）；重叠调度
开或关、radix 或 naive，输出都相同，并与 HF 逐 token 相同。"""

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.llm import LLM

# another model folder may be given: `python main.py models/tiny-qwen3` (on a GPU machine, say)
MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
SYSTEM = (
    "You are the assistant of a small bakery in a seaside town. The bakery opens at seven in the "
    "morning and closes at six in the evening, every day except Monday, when the bakers rest. "
    "It sells sourdough, rye bread, whole wheat loaves, baguettes, croissants, pain au chocolat, "
    "cinnamon rolls, scones, apple pie and carrot cake, and on Fridays a lemon tart that sells "
    "out by noon. Birthday and wedding cakes must be ordered at least three days in advance, "
    "and the customer chooses the filling: chocolate, vanilla, strawberry or lemon. Delivery is "
    "free within five kilometres and costs four euros beyond that, up to twenty kilometres. "
    "The bakery uses organic flour from a mill in the next valley and bakes everything on site "
    "before dawn. Gluten-free bread is available on Wednesdays only. Prices are written on the "
    "board by the door; never invent prices or products that are not listed here. Answer every "
    "question in one short, friendly sentence."
)
QUESTIONS = [
    "When do you open on Sunday morning?", "Do you sell rye bread every day?",
    "Can I order a wedding cake for tomorrow?", "How much is delivery to a village nearby?",
    "Which pastries can I buy for breakfast?", "Are you open on Mondays at all?",
    "On which day can I get the lemon tart?", "Do you have gluten-free bread today?",
]


def main() -> None:
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: run `python tools/models.py smollm2` in the repository root")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for q in QUESTIONS]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b)
                 for p in prompts[1:])
    print(f"8 prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
          f"they share the first {shared}, the shortest suffix has "
          f"{min(len(p) - shared for p in prompts)}")
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)

    runs, computed = {}, {}
    for cache_type, overlap in (("radix", True), ("naive", True), ("radix", False)):
        os.environ["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "0" if overlap else "1"
        # float32 everywhere, on a GPU too, so that HF float32 is the exact reference
        llm = LLM(str(MODEL), dtype=torch.float32, cache_type=cache_type, num_page_override=4096)
        outputs = llm.generate(prompts, greedy)
        s = llm.stats
        print(f"{cache_type}, overlap {'on ' if overlap else 'off'}: {s.prefill_batches} prefill "
              f"batches computed {s.prefill_tokens} prompt tokens ({s.cached_tokens} from the "
              f"cache), then {s.decode_batches} decode batches")
        runs[cache_type, overlap] = [o["token_ids"] for o in outputs]
        computed[cache_type, overlap] = s.prefill_tokens
        llm.shutdown()
    ratio = computed["radix", True] / computed["naive", True]
    print(f"LLM ran on {llm.device}")
    print(f"radix computes {ratio:.3f} of naive's prefill tokens (at most 1/4: {ratio <= 0.25})")

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    same_as_hf = 0
    for q, ids, out in zip(QUESTIONS, prompts, runs["radix", True]):
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                          do_sample=False)[0, x.shape[1]:].tolist()
        same_as_hf += out == ref
        print(f"{q!r} -> {tokenizer.decode(out, skip_special_tokens=True)!r}")
    print(f"radix == naive: {runs['radix', True] == runs['naive', True]}, "
          f"overlap on == off: {runs['radix', True] == runs['radix', False]}, "
          f"same as HF: {same_as_hf}/8")


if __name__ == "__main__":
    main()
