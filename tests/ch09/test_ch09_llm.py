"""Chapter 9: the radix cache inside the scheduler: shared prefixes computed once (counted by
the scheduler), later calls hit the cache, eviction under a small pool, and the duplicate
prefix of two requests admitted together."""

from __future__ import annotations

import logging

import pytest
import torch

from minisgl.core import SamplingParams

from reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, seed: int = 0,
                          ) -> list[list[int]]:
    """n prompts: the same random prefix, then a distinct random suffix each."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (suffix_len,), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize(("name", "page_size"), [("tiny-qwen3", 1), ("tiny-qwen2", 4),
                                               ("tiny-mistral", 1), ("tiny-llama", 4)])
def test_shared_prefix_is_computed_once(name: str, page_size: int, model_dir, make_llm) -> None:
    """Four prompts: 64 shared random tokens, then 8 of their own; four tiny models (page size 1
    for qwen3 and mistral, 4 for qwen2 and llama). radix and naive give the same tokens, equal to
    HF. naive computes 4 x 72 = 288 prompt tokens, radix at most 72 + 3 x (8 + page_size - 1): the
    first prompt whole, the others their suffixes. The four arrive together into an empty cache, so
    only the deferral rule (PrefillManager._shares_with) reaches that bound."""
    path = model_dir(name)
    prompts = shared_prefix_prompts(4, 64, 8)
    outputs, computed = {}, {}
    for cache_type in ("radix", "naive"):
        llm = make_llm(path, cache_type=cache_type, page_size=page_size)
        outputs[cache_type] = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
        computed[cache_type] = llm.stats.prefill_tokens
        llm.shutdown()
    assert outputs["radix"] == outputs["naive"]
    assert outputs["radix"] == [hf_greedy(path, p, 8)[0] for p in prompts]
    assert computed["naive"] == 4 * 72
    # the first prompt whole, then each other one's suffix and at most a page of rounding
    assert computed["radix"] <= 72 + 3 * (8 + page_size - 1)


def test_second_call_finds_the_first_calls_prompts(model_dir, make_llm) -> None:
    """tiny-llama, page size 1: three prompts sharing 40 tokens, generated twice. The second call
    gives the same outputs and computes 3 tokens, each prompt's last; idle, the cache holds nothing
    locked."""
    path = model_dir("tiny-llama")
    prompts = shared_prefix_prompts(3, 40, 10, seed=1)
    llm = make_llm(path)
    first = llm.generate(prompts, GREEDY)
    before = llm.stats.prefill_tokens
    again = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]
    assert llm.stats.prefill_tokens - before == 3  # only each prompt's last token
    info = llm.cache_manager.prefix_cache.size_info
    assert info.protected_size == 0 and info.evictable_size > 0  # idle: nothing locked


def test_eviction_keeps_outputs_right(model_dir, make_llm) -> None:
    """A pool of 96 slots that cannot keep every earlier prompt: four rounds of two new prompts
    force evictions. Each round equals HF and no page is lost; rerunning the newest round computes
    at most 8 tokens, since the least recently used prompts went first. The two prompts of a round
    share only 24 tokens (less than DEFER_MIN_SHARED = 32), so they are admitted together and the
    duplicate prefix is found at insertion: this test relies on the repointing in cache_req too."""
    path = model_dir("tiny-qwen3")
    llm = make_llm(path, num_page_override=24, page_size=4)  # 96 slots
    rounds = [shared_prefix_prompts(2, 24, 6, seed=s) for s in range(4)]
    for prompts in rounds:
        out = llm.generate(prompts, GREEDY)
        assert [o["token_ids"] for o in out] == [hf_greedy(path, p, 8)[0] for p in prompts]
        cache = llm.cache_manager
        assert len(cache.free_slots) * 4 + cache.prefix_cache.size_info.total_size == 96
    # the newest round's prompts are still cached, so running it again computes little
    before = llm.stats.prefill_tokens
    llm.generate(rounds[-1], GREEDY)
    assert llm.stats.prefill_tokens - before <= 2 * 4


def test_identical_prompts_admitted_together(model_dir, make_llm, caplog) -> None:
    """A and B have the same 20-token prompt; C has 30 tokens; page size 1, 64 pages, 4 tokens
    each. Step 1: A and B share 19 tokens (< 32, no deferral) and are prefilled together on pages
    0-19 and 20-39 (neither can see the other's K/V); C (34 tokens of room on top of their 48)
    waits. A is cached first; B finds the 20 tokens cached, frees 20-39 and points its row at 0-19.
    Step 2: C takes 40-63, then 20-25, and writes its K/V there. B must read A's pages from then
    on: were its row still on 20-39, its first token (from the prefill) would be right and the
    later ones would read C's K/V."""
    path = model_dir("tiny-qwen3")
    a = shared_prefix_prompts(1, 20, 0, seed=2)[0]
    c = shared_prefix_prompts(1, 30, 0, seed=3)[0]
    llm = make_llm(path, page_size=1, num_page_override=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate([a, a, c], params)
    steps = [r.getMessage().split() for r in caplog.records if r.name.startswith("minisgl")]
    assert steps[0] == ["prefill", "0+20", "1+20"] and steps[1] == ["prefill", "2+30"]
    ref_a, ref_c = hf_greedy(path, a, 4)[0], hf_greedy(path, c, 4)[0]
    assert [o["token_ids"] for o in out] == [ref_a, ref_a, ref_c]
