"""Chapter 21: the request's contract is written once. LLM.generate and the server refuse a
prompt that can never run with the same function, so in the same words."""

from __future__ import annotations

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.message import UserMsg
from minisgl.scheduler.io import ServerScheduler


def test_llm_and_the_server_refuse_a_prompt_in_the_same_words(model_dir, make_llm) -> None:
    llm = make_llm(model_dir("tiny-qwen3"), max_seq_len_override=32, num_page_override=64)
    for ids in ([], list(range(3, 3 + 32))):  # empty; no room left for an output token
        msg = UserMsg(0, torch.tensor(ids, dtype=torch.int32), SamplingParams(max_tokens=4))
        # the server's check (it needs only the limits, which the offline LLM has alike)
        answer = ServerScheduler._check(llm, msg)  # type: ignore[arg-type]
        assert answer is not None and answer.startswith("the prompt ")
        with pytest.raises(ValueError) as refused:
            llm.generate([ids], SamplingParams(max_tokens=4))
        assert str(refused.value) == "prompt 0 " + answer.removeprefix("the prompt ")
    assert llm.stats.prefill_batches == 0  # nothing ran
