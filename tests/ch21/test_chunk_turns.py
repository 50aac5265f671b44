"""The server's decode turns between prefill chunks go to those who need them. A wave of short
prompts on an idle scheduler that spans a few prefill steps (the budget cuts one of them in
two) is filled back to back: the streams it starts pause once after it, not once per chunk.
Streams already flowing when the prompts came get their turns, and so does everyone while a
prompt longer than a step is filled (chapter 15's fairness). Outputs are HF's either way."""

from __future__ import annotations

import logging

import pytest
import torch

from minisgl.core import SamplingParams

from helpers import batches
from reference import hf_greedy

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def run(model_dir, make_llm, caplog, lengths: tuple[int, ...], max_tokens: tuple[int, ...] = (),
        **config) -> list[tuple[str, list[int]]]:
    path = model_dir("tiny-llama")
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in max_tokens] or GREEDY
    budget = config.pop("max_extend_tokens_override", 8)
    llm = make_llm(path, max_extend_tokens=budget, **config)
    llm.decode_between_chunks = True  # the server's policy
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        out = llm.generate(ids, params)
    wanted = max_tokens or (6,) * len(ids)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, x, k)[0]
                                             for x, k in zip(ids, wanted)]
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


def test_streams_flowing_before_a_wave_get_their_turns(model_dir, make_llm, caplog) -> None:
    # three rows: requests 0-2 start together (2 is cut across two steps, back to back); 1 and 2
    # stop after 2 tokens, and 3 and 4 (5 tokens each, 4 cut in two) come in while 0 flows
    seen = run(model_dir, make_llm, caplog, (4, 3, 3, 5, 5), (12, 2, 2, 6, 6), max_running_req=3)
    assert seen[:2] == [("prefill", [0, 1, 2]), ("prefill", [2])], seen
    first = next(i for i, (phase, uids) in enumerate(seen) if phase == "prefill" and 4 in uids)
    assert seen[first][1] == [3, 4] and seen[first + 1][0] == "decode", seen
    assert 0 in seen[first + 1][1] and seen[first + 2] == ("prefill", [4]), seen


def steps(caplog) -> list[tuple[str, dict[int, int]]]:
    """(phase, {uid: tokens computed}) of every batch the scheduler logged."""
    out = []
    for record in caplog.records:
        if record.name == "minisgl.scheduler.scheduler" and record.levelno == logging.DEBUG:
            phase, *reqs = record.getMessage().split()
            out.append((phase, {int(u): int(n) for u, n in (r.split("+") for r in reqs)}))
    return out


@pytest.mark.parametrize("limit", [0, 4])
def test_streaming_prefill_length_bounds_the_steps_streams_wait_for(model_dir, make_llm, caplog,
                                                                   limit: int) -> None:
    # request 0 flows while 3 and 4 (9 prompt tokens each) wait for rows: with the limit on,
    # their prefill comes 4 tokens a step, each step followed by a decode step for 0; the first
    # wave (nobody flowing yet) still takes the whole budget of 16
    run(model_dir, make_llm, caplog, (4, 3, 3, 9, 9), (14, 2, 2, 3, 3), max_running_req=3,
        streaming_extend_tokens=limit, max_extend_tokens_override=16)
    seen = steps(caplog)
    assert seen[0] == ("prefill", {0: 4, 1: 3, 2: 3}), seen
    later = [i for i, (phase, _) in enumerate(seen) if phase == "prefill" and i > 0]
    assert sum(sum(seen[i][1].values()) for i in later) == 18, seen
    biggest = max(sum(seen[i][1].values()) for i in later)
    if limit:
        assert biggest <= limit and len(later) == 5, seen
        assert all(seen[i + 1][0] == "decode" and 0 in seen[i + 1][1] for i in later), seen
    else:
        assert biggest == 16, seen


def test_the_streaming_prefill_flag(model_dir, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.server.args import GPU_STREAMING_CHUNK, parse_args

    model = str(model_dir("tiny-qwen3"))
    assert parse_args(["--model", model]).scheduler.streaming_extend_tokens == 0  # the CPU: off
    flag = ["--model", model, "--streaming-prefill-length"]
    assert parse_args([*flag, "64"]).scheduler.streaming_extend_tokens == 64
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a GPU: on by default
    assert parse_args(["--model", model]).scheduler.streaming_extend_tokens == GPU_STREAMING_CHUNK
    assert parse_args([*flag, "0"]).scheduler.streaming_extend_tokens == 0
    with pytest.raises(SystemExit):
        parse_args([*flag, "-1"])
    assert "--streaming-prefill-length must be 0 (off) or more, not -1" in capsys.readouterr().err
