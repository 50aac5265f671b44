"""Chapter 15: fairness. The server's scheduler gives the running requests every other step
while a long prompt is prefilled in chunks, so their streams slow down instead of stopping; the
offline LLM keeps prefill first. Outputs are HF's either way."""

from __future__ import annotations

import logging

import torch

from minisgl.core import SamplingParams

from helpers import batches
from reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def run(model_dir, make_llm, caplog, between: bool) -> list[tuple[str, list[int]]]:
    path = model_dir("tiny-llama")
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 40)]
    llm = make_llm(path, max_extend_tokens=8)
    llm.decode_between_chunks = between
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate(ids, GREEDY)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, 8)[0] for x in ids]
    return batches(caplog)


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(model_dir, make_llm,
                                                                     caplog) -> None:
    seen = run(model_dir, make_llm, caplog, between=True)
    chunks = [i for i, (phase, uids) in enumerate(seen) if phase == "prefill" and 1 in uids]
    assert len(chunks) == 6  # 40 tokens: 4 beside request 0's prompt, then 8, 8, 8, 8, 4
    # after every part but the last, request 0 (running since the first batch) takes a step
    assert all(seen[i + 1] == ("decode", [0]) for i in chunks[:-1]), seen


def test_the_offline_llm_keeps_prefill_first(model_dir, make_llm, caplog) -> None:
    seen = run(model_dir, make_llm, caplog, between=False)
    chunks = [i for i, (phase, uids) in enumerate(seen) if phase == "prefill" and 1 in uids]
    assert chunks == list(range(len(chunks)))  # back to back: request 0 waits for them all
