"""The overlap loop hands a batch's tokens out before the next launch when they are already on
the host and a prefill is on either side (Scheduler._hand_out_if_ready): first tokens leave
before the next batch is scheduled, and a decode's tokens before a prefill's long launch. On
the CPU every copy event is ready; a BusyEvent stands for a GPU still computing, and then the
order is the overlap loop's. Outputs are HF's either way; the step trace and the step timer
say when the tokens left (the step timer's row: tests/ch21/test_online.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from benchmarks import load

from minisgl.core import SamplingParams

from helpers import BusyEvent, batches
from reference import hf_greedy

online = load("online")

THREE = SamplingParams(max_tokens=3, ignore_eos=True)


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def spied(llm, busy: bool) -> list[str]:
    """The launches (with their phase) and the hand-outs of one LLM, in order."""
    events: list[str] = []
    forward, process = llm._forward, llm._process_last_data

    def spy_forward(fi):
        events.append(f"launch {fi.batch.phase}")
        out = forward(fi)
        return out._replace(copy_done=BusyEvent()) if busy else out

    def spy_process(data):
        if data is not None:
            events.append(f"hand out {data[0].batch.phase}")
        return process(data)

    llm._forward, llm._process_last_data = spy_forward, spy_process
    return events


@pytest.mark.parametrize("busy", [False, True])
def test_first_tokens_leave_before_the_next_launch(model_dir, make_llm, busy: bool) -> None:
    path = model_dir("tiny-qwen3")
    ids = prompts(9, 14)
    llm = make_llm(path, overlap=True)
    events = spied(llm, busy)
    out = llm.generate(ids, THREE)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, 3)[0] for x in ids]
    if busy:  # the overlap order: a batch's tokens after the next launch
        assert events == ["launch prefill", "launch decode", "hand out prefill", "launch decode",
                          "hand out decode", "hand out decode"]
    else:  # ready: the prefill's first tokens before the decode is even scheduled
        assert events == ["launch prefill", "hand out prefill", "launch decode", "launch decode",
                          "hand out decode", "hand out decode"]


@pytest.mark.parametrize("busy", [False, True])
def test_a_decodes_tokens_leave_before_a_prefills_launch(model_dir, make_llm, caplog,
                                                         busy: bool) -> None:
    # two rows: request 2 waits for request 0's row, so its prefill comes while 1 decodes
    path = model_dir("tiny-qwen3")
    ids, lengths = prompts(9, 14, 11), (2, 6, 3)
    llm = make_llm(path, overlap=True, max_running_req=2)
    events = spied(llm, busy)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate(ids, [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths])
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, k)[0]
                                             for x, k in zip(ids, lengths)]
    assert batches(caplog)[:4] == [("prefill", [0, 1]), ("decode", [0, 1]), ("decode", [1]),
                                   ("prefill", [2])]
    second = [i for i, e in enumerate(events) if e == "launch prefill"][1]
    if busy:  # request 1's token waits behind request 2's launch
        assert events[second - 2:second + 2] == ["launch decode", "hand out decode",
                                                 "launch prefill", "hand out decode"], events
    else:
        assert events[second - 3:second + 1] == ["launch decode", "hand out decode",
                                                 "hand out decode", "launch prefill"], events


def test_the_step_trace_says_when_tokens_left_early(make_llm, model_dir, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINISGL_STEP_TRACE", str(trace))
    llm = make_llm(model_dir("tiny-qwen3"), overlap=True)
    llm.generate(prompts(9, 14), THREE)
    llm.trace.write()
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [r.get("phase") for r in rows] == ["prefill", "decode", "decode", None]
    after_prefill = rows[1]
    assert "early" in after_prefill and all("early" not in r for r in rows[2:])
    # it left after the receive and before the launch began; the hand-out counts as reply
    assert after_prefill["receive"] <= after_prefill["early"] <= (
        after_prefill["receive"] + after_prefill["prepare"] + after_prefill["reply"] + 0.01)
    assert all(r[p] >= 0 for r in rows for p in online.PARTS)
