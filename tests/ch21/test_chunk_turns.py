"""The server's decode turns between prefill chunks are for long prompts only. A wave of short
prompts that spans a few prefill steps (the budget cuts one of them in two) is filled back to
back: streams pause once after it, not once per chunk. A prompt longer than a step still gets
the turns (chapter 15's fairness). Outputs are HF's either way."""

from __future__ import annotations

import logging

import pytest
import torch

from minisgl.core import SamplingParams

from helpers import batches
from reference import hf_greedy

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def run(model_dir, make_llm, caplog, lengths: tuple[int, ...]) -> list[tuple[str, list[int]]]:
    path = model_dir("tiny-llama")
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    llm = make_llm(path, max_extend_tokens=8)
    llm.decode_between_chunks = True  # the server's policy
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate(ids, GREEDY)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, 6)[0] for x in ids]
    return batches(caplog)


def test_a_wave_of_short_prompts_is_filled_back_to_back(model_dir, make_llm, caplog) -> None:
    # 4 + 7 + 7 + 7 tokens at 8 a step: requests 1, 2 and 3 are each cut across two steps
    seen = run(model_dir, make_llm, caplog, (4, 7, 7, 7))
    assert seen[:5] == [("prefill", [0, 1]), ("prefill", [1, 2]), ("prefill", [2, 3]),
                        ("prefill", [3]), ("decode", [0, 1, 2, 3])], seen


@pytest.mark.parametrize("long", [9, 20])
def test_a_prompt_longer_than_a_step_still_gives_turns(model_dir, make_llm, caplog,
                                                       long: int) -> None:
    seen = run(model_dir, make_llm, caplog, (4, long))
    parts = [i for i, (phase, uids) in enumerate(seen) if phase == "prefill" and 1 in uids]
    assert len(parts) == -(-(long + 4) // 8)
    assert all(seen[i + 1] == ("decode", [0]) for i in parts[:-1]), seen
