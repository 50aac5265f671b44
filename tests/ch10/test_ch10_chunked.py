"""Chapter 10: chunked prefill: the max_extend_tokens budget, ChunkedReq, and unchanged
outputs whatever the budget, page size or prefix cache."""

from __future__ import annotations

import logging

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler.prefill import ChunkedReq

from reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def logged(caplog) -> list[tuple[str, list[tuple[int, int]]]]:
    """(phase, [(uid, new tokens), ...]) of every batch the scheduler logged."""
    out = []
    for record in caplog.records:
        if record.name == "minisgl.scheduler.scheduler" and record.levelno == logging.DEBUG:
            phase, *reqs = record.getMessage().split()
            out.append((phase, [tuple(map(int, r.split("+"))) for r in reqs]))
    return out


@pytest.mark.parametrize("budget", [1, 7, 8192])
@pytest.mark.parametrize("page_size", [1, 4])
def test_any_budget_gives_the_same_tokens(budget: int, page_size: int, model_dir, make_llm,
                                          caplog) -> None:
    path = model_dir("tiny-qwen3" if page_size == 1 else "tiny-mistral")
    ids = prompts([40, 5, 13])
    llm = make_llm(path, max_extend_tokens=budget, page_size=page_size)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate(ids, GREEDY)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, 8)[0] for x in ids]
    seen = logged(caplog)
    prefills = [reqs for phase, reqs in seen if phase == "prefill"]
    assert all(sum(n for _, n in reqs) <= budget for reqs in prefills)
    assert sum(n for reqs in prefills for _, n in reqs) == 58  # every prompt token once
    assert llm.stats.prefill_batches == len(prefills) == -(-58 // budget)  # no budget wasted


def test_a_chunked_prompt_does_not_decode_until_done(model_dir, make_llm, caplog) -> None:
    path = model_dir("tiny-llama")
    ids = prompts([30, 4], seed=1)
    llm = make_llm(path, max_extend_tokens=8)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate(ids, GREEDY)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, 8)[0] for x in ids]
    seen = logged(caplog)
    # 30 tokens in parts of 8: the first three batches are prefill parts of request 0 only
    assert seen[:3] == [("prefill", [(0, 8)])] * 3
    # the last 6 tokens of request 0 share a batch with request 1's first 2
    assert seen[3] == ("prefill", [(0, 6), (1, 2)])
    assert seen[4] == ("prefill", [(1, 2)]) and seen[5][0] == "decode"
    assert [uid for uid, _ in seen[5][1]] == [0, 1]


def test_chunks_with_a_shared_prefix(model_dir, make_llm) -> None:
    """Chunked prompts and the radix cache together: the shared prefix is still computed
    once, and the outputs are those of the naive cache without chunks."""
    path = model_dir("tiny-qwen2")
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 500, (48,), generator=g).tolist()
    ids = [prefix + torch.randint(3, 500, (9,), generator=g).tolist() for _ in range(3)]
    llm = make_llm(path, max_extend_tokens=16, page_size=4)
    out = [o["token_ids"] for o in llm.generate(ids, GREEDY)]
    computed = llm.stats.prefill_tokens
    llm.shutdown()
    plain = make_llm(path, cache_type="naive")
    assert out == [o["token_ids"] for o in plain.generate(ids, GREEDY)]
    assert computed <= 57 + 2 * (9 + 3)


def test_budget_must_be_positive(model_dir) -> None:
    with pytest.raises(ValueError, match="max_extend_tokens must be at least 1"):
        LLM(str(model_dir("tiny-qwen3")), max_extend_tokens=0)


def test_chunked_req_has_no_next_token() -> None:
    from minisgl.core import SamplingParams as SP

    req = ChunkedReq(torch.arange(8, dtype=torch.int32), 0, 0, 4, 0, SP())
    assert not req.can_decode
    with pytest.raises(RuntimeError, match="no next token"):
        req.append_host(torch.tensor([1]))
