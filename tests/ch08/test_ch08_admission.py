"""Chapter 8: admission control: length checks before any work, max_tokens clipping, and
requests that wait for KV room (their own and the running requests' reservations)."""

from __future__ import annotations

import logging

import pytest

from minisgl.core import SamplingParams

from helpers import batches
from reference import hf_greedy, hf_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:",
           "Once upon a time, in a small village by the sea,", "Water boils at"]


def test_too_long_prompt_is_refused_before_any_work(model_dir, make_llm) -> None:
    path = model_dir("tiny-qwen3")
    llm = make_llm(path, max_seq_len_override=32, num_page_override=64)
    long = list(range(3, 3 + 32))  # 32 token ids: fills max_seq_len, no room for output
    with pytest.raises(ValueError, match=r"prompt 1 has 32 tokens; max_seq_len is 32"):
        llm.generate([[5, 6, 7], long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    assert llm.stats.prefill_batches == 0  # nothing ran
    out = llm.generate([long[:31]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 1  # 31 tokens leave room for exactly one


def test_max_tokens_is_clipped_to_the_room_left(model_dir, make_llm, caplog) -> None:
    path = model_dir("tiny-llama")
    ids = hf_tokenizer(path)(PROMPTS[3])["input_ids"]
    llm = make_llm(path, max_seq_len_override=len(ids) + 7, num_page_override=64)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="minisgl.scheduler"):
        out = llm.generate([ids], params)[0]["token_ids"]
    assert out == hf_greedy(path, ids, 7)[0]
    assert params.max_tokens == 100  # the caller's object is not changed
    assert "max_tokens 100 clipped to 7" in caplog.text


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-mistral"])
def test_requests_wait_for_kv_room_and_still_match_hf(name: str, model_dir, make_llm,
                                                      caplog) -> None:
    """20 pages of 4 tokens; each request may need up to 10 pages: they cannot all run at once."""
    path = model_dir(name)
    ids = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS]
    llm = make_llm(path, page_size=4, num_page_override=20, max_running_req=8)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        outputs = llm.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    for x, out in zip(ids, outputs):
        assert out["token_ids"] == hf_greedy(path, x, 12)[0]
    seen = batches(caplog)
    assert sum(phase == "prefill" for phase, _ in seen) >= 2  # some had to wait
    # the requests decoding together never could need more than the pool's 80 slots
    assert all(sum(len(ids[u]) + 12 for u in uids) <= 80 for phase, uids in seen
               if phase == "decode")


def test_estimate_rounds_up(model_dir, make_llm, caplog) -> None:
    """Eight 2-token prompts, 8 output tokens each, 20 pages of 4: each ends up in 3 pages (24
    in all). Estimating prompt + output (10 each, 80 in all) admits all eight at once and runs
    out of pages in the 7th decode; with the page of rounding (13 each) six come in first."""
    path = model_dir("tiny-qwen3")
    ids = [[3 + 2 * i, 4 + 2 * i] for i in range(8)]
    llm = make_llm(path, page_size=4, num_page_override=20)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        outputs = llm.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    for x, out in zip(ids, outputs):
        assert out["token_ids"] == hf_greedy(path, x, 8)[0]
    prefills = [uids for phase, uids in batches(caplog) if phase == "prefill"]
    assert prefills == [[0, 1, 2, 3, 4, 5], [6, 7]]


def test_a_request_never_needs_more_than_an_empty_pool(model_dir, make_llm) -> None:
    """max_tokens is clipped so that prompt + output + a page of rounding fits the whole pool
    (20 pages of 4 = 80 slots): otherwise the request could never be admitted."""
    path = model_dir("tiny-qwen3")
    llm = make_llm(path, page_size=4, num_page_override=20, max_seq_len_override=80)
    assert llm.max_seq_len == 77
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out[0]["token_ids"]) == 72


def test_running_requests_keep_their_reservation(model_dir, make_llm, caplog) -> None:
    """Two requests that each may need 12 of the 20 pages: the second waits until the first
    has finished, although right after the first one's prefill most pages are still free."""
    path = model_dir("tiny-qwen3")
    ids = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS[:2]]
    llm = make_llm(path, page_size=4, num_page_override=20)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        outputs = llm.generate(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    for x, out in zip(ids, outputs):
        assert out["token_ids"] == hf_greedy(path, x, 40)[0]
    seen = batches(caplog)
    second = seen.index(("prefill", [1]))
    assert second == 40  # after the first request's prefill and its 39 decode steps
    assert all(uids == [0] for _, uids in seen[:second])
