"""Chapter 22: admission by expected need. The new-token ratio (SGLang's numbers: 0.7, a floor of
0.14 of that, 600 decode steps down, the survivors' estimate after a retraction, back at idle);
what running requests keep; `conservative` admitting exactly as chapter 8 did and never
retracting; `expected` running more requests at once where max_tokens is far above the real
output; the settings refused with a message that says what to do."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.admission import (
    CLIP_MAX_NEW_TOKENS,
    NewTokenRatio,
    generated_len,
    prompt_len,
    retraction_order,
)
from minisgl.scheduler.decode import DecodeManager
from minisgl.server.args import parse_args

from driver import Driver, early_stopping, prompts, reference
from helpers import batches


def running_req(uid: int, prompt: int, generated: int, max_tokens: int,
                ignore_eos: bool = False) -> Req:
    """A running request as the scheduler holds it: `generated` output tokens on the host."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    req = Req(torch.arange(prompt, dtype=torch.int32), table_idx=uid, cached_len=prompt - 1,
              output_len=max_tokens, uid=uid, sampling_params=params)
    for token in range(generated):
        req.complete_one()
        req.append_host(token)
    return req


def test_ratio_starts_decays_to_the_floor_and_resets() -> None:
    r = NewTokenRatio()
    assert (r.init, r.value) == (0.7, 0.7) and r.floor == pytest.approx(0.098)
    assert r.step == pytest.approx((0.7 - 0.098) / 600)
    for k in range(1, 600):
        r.decay()
        assert r.value == pytest.approx(0.7 - k * r.step)
    r.decay()
    r.decay()  # 601 steps: no lower than the floor
    assert r.value == r.floor
    r.reset()
    assert r.value == r.init
    assert NewTokenRatio(0.5).init == pytest.approx(0.35)
    assert NewTokenRatio(2.0).init == 1.0  # never above 1
    assert NewTokenRatio(2.0).floor == pytest.approx(0.14)


def test_ratio_after_a_retraction_follows_the_survivors_and_never_falls() -> None:
    survivors = [running_req(0, 10, 5, 40), running_req(1, 6, 15, 60)]
    assert [generated_len(r) for r in survivors] == [5, 15]
    assert [prompt_len(r) for r in survivors] == [10, 6]
    estimate = (5 + 15 + 20 * 2) / (40 + 60 + 1)
    r = NewTokenRatio(0.3)
    r.after_retraction(survivors)
    assert r.value == pytest.approx(estimate)  # 0.594, up from 0.21
    r = NewTokenRatio()
    r.value = 0.8
    r.after_retraction(survivors)
    assert r.value == 0.8  # a retraction never lowers the guess
    r.after_retraction([running_req(2, 4, 3, 10)])
    assert r.value == 1.0  # (3 + 20) / 11, capped


def test_what_a_running_request_keeps() -> None:
    """ceil(min(remaining, 4096) * ratio), all of it when the request ignores EOS; plus a page
    of rounding each. None (conservative): all of the remaining output, unclipped."""
    r = NewTokenRatio()
    sampled, known = running_req(0, 8, 3, 40), running_req(1, 8, 3, 40, ignore_eos=True)
    assert sampled.remain_len == known.remain_len == 37
    assert r.expected_need(sampled) == math.ceil(37 * 0.7) == 26
    assert r.expected_need(known) == 37
    huge = running_req(2, 8, 0, 10_000)
    assert r.expected_need(huge) == math.ceil(CLIP_MAX_NEW_TOKENS * 0.7)
    expected, conservative = DecodeManager(4, r), DecodeManager(4)
    for manager in (expected, conservative):
        manager.running = {q.uid: q for q in (sampled, known, huge)}
    assert expected.inflight_tokens == 26 + 37 + math.ceil(4096 * 0.7) + 3 * 3
    assert conservative.inflight_tokens == 37 + 37 + 10_000 + 3 * 3


def test_retraction_order_is_a_total_order() -> None:
    """Fewest output tokens first, then the longest prompt, then the highest uid."""
    reqs = [running_req(0, 5, 2, 20), running_req(1, 9, 2, 20), running_req(2, 9, 2, 20),
            running_req(3, 30, 4, 20), running_req(4, 2, 0, 20)]
    assert [r.uid for r in retraction_order(reqs)] == [4, 2, 1, 0, 3]
    assert [r.uid for r in retraction_order(reqs[::-1])] == [4, 2, 1, 0, 3]


def test_ratio_decays_per_decode_step_and_is_back_at_idle(model_dir: Callable[[str], Path],
                                                          make_driver: Callable[..., Driver],
                                                          ) -> None:
    """One request of 605 tokens in a large pool: after n decode steps (prefills do not count)
    the ratio is init - n * step, down to the floor from the 600th on; once nothing is left
    to run it is back at the start."""
    driver = make_driver(model_dir("tiny-qwen3"), num_page_override=1024)
    ratio = driver.ratio
    assert ratio is not None
    seen: list[tuple[int, float]] = []
    driver.after_step.append(lambda d: d.runnable and seen.append(
        (d.stats.decode_batches, d.new_token_ratio)))
    driver.submit(0, [5, 6, 7], SamplingParams(max_tokens=605))
    driver.run()
    assert driver.stats.decode_batches == 604 and driver.stats.retractions == 0
    assert [n for n, _ in seen] == list(range(len(seen)))  # every step, while it runs
    assert all(value == pytest.approx(max(ratio.init - n * ratio.step, ratio.floor))
               for n, value in seen)
    assert [value for n, value in seen if n >= 600] == [ratio.floor] * (len(seen) - 600)
    assert driver.new_token_ratio == ratio.init


def test_a_retraction_sets_the_ratio_from_the_survivors(model_dir: Callable[[str], Path],
                                                        make_driver: Callable[..., Driver],
                                                        caplog: pytest.LogCaptureFixture,
                                                        ) -> None:
    """Each retraction: the new ratio is max(old, (output + 20 n) / (max_tokens + 1)) over the
    requests left running, which are exactly the decode batch that follows; the log line
    says old -> new. Once idle it is back at the start."""
    driver = make_driver(model_dir("tiny-qwen3"), num_page_override=120,
                         schedule_conservativeness=0.1)
    ratio = driver.ratio
    assert ratio is not None
    events: list[tuple[float, float, list[int]]] = []
    after = ratio.after_retraction

    def spy(survivors: list[Req]) -> None:
        before = ratio.value
        after(survivors)
        estimate = (sum(map(generated_len, survivors)) + 20 * len(survivors)) / (
            sum(r.sampling_params.max_tokens for r in survivors) + 1)
        assert ratio.value == max(before, min(1.0, estimate))
        events.append((before, ratio.value, [r.uid for r in survivors]))

    ratio.after_retraction = spy  # type: ignore[method-assign]
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        for uid, prompt in enumerate(prompts(12)):
            driver.submit(uid, prompt, SamplingParams(max_tokens=48))
        driver.run()
    assert events and driver.stats.retractions == len(events)
    records = [r.getMessage() for r in caplog.records if r.name == "minisgl.scheduler.scheduler"]
    at = [i for i, line in enumerate(records) if "retracted" in line]
    assert len(at) == len(events)
    for i, (before, new, survivors) in zip(at, events):
        assert f"new-token ratio {before:.4f} -> {new:.4f}" in records[i]
        phase, *reqs = records[i + 1].split()  # the batch scheduled right after
        assert phase == "decode" and [int(r.split("+")[0]) for r in reqs] == sorted(survivors)
    assert driver.new_token_ratio == ratio.init


# chapter 8's rule, recorded before chapter 22 from the code of that time: the prefill batches
# (uids) and the number of batches of the workload below, with overlap and without
OLD_RULE = {
    True: ([[0, 1], [2], [3], [4], [5], [6], [7], [8, 9], [10], [11], [12, 13], [14],
            [15, 16], [17]], 49),
    False: ([[0, 1], [2], [3], [4], [5, 6], [7], [8], [9, 10], [11], [12], [13], [14, 15],
             [16], [17]], 40),
}


def early_stopping_run(driver: Driver, eos: int, batch: list[list[int]],
                       caplog: pytest.LogCaptureFixture) -> list[tuple[str, list[int]]]:
    """Run `batch` with max_tokens 24 and `eos` as EOS; the batches it took."""
    driver.eos_token_id = eos
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        for uid, prompt in enumerate(batch):
            driver.submit(uid, prompt, SamplingParams(max_tokens=24))
        driver.run()
    return batches(caplog)


@pytest.mark.parametrize("overlap", [True, False])
def test_expected_runs_more_at_once_and_conservative_admits_as_before(
        overlap: bool, model_dir: Callable[[str], Path], make_driver: Callable[..., Driver],
        caplog: pytest.LogCaptureFixture) -> None:
    """18 requests that stop after 1-6 tokens (a chosen EOS, see early_stopping) with
    max_tokens 24, in 24 pages of 4. Conservative takes exactly chapter 8's batches; expected,
    with the same outputs and no retraction, decodes more requests together and needs fewer
    steps."""
    path = model_dir("tiny-qwen3")
    eos, chosen, outs = early_stopping(path)
    assert len(chosen) == 9 and all(1 <= len(o) <= 6 for o in outs)
    batch, expected_out = chosen * 2, outs * 2
    seen = {}
    for admission in ("conservative", "expected"):
        driver = make_driver(path, overlap=overlap, page_size=4, num_page_override=24,
                             max_running_req=8, admission=admission)
        seen[admission] = early_stopping_run(driver, eos, batch, caplog)
        assert [driver.tokens(u) for u in range(len(batch))] == expected_out
        assert driver.stats.retractions == 0
        driver.shutdown()
    prefills = [uids for phase, uids in seen["conservative"] if phase == "prefill"]
    assert (prefills, len(seen["conservative"])) == OLD_RULE[overlap]
    decoded = {a: [len(uids) for phase, uids in b if phase == "decode"] for a, b in seen.items()}
    assert max(decoded["expected"]) > max(decoded["conservative"]) == 2
    assert sum(decoded["expected"]) / len(decoded["expected"]) > 1.25 * (
        sum(decoded["conservative"]) / len(decoded["conservative"]))
    assert len(seen["expected"]) < len(seen["conservative"])


def test_conservative_never_retracts(model_dir: Callable[[str], Path],
                                     make_driver: Callable[..., Driver]) -> None:
    """The workload that makes expected admission retract (test_ch22_retract.py): none here,
    and the same outputs."""
    path = model_dir("tiny-qwen3")
    batch = prompts(12)
    expected = reference(path, tuple(map(tuple, batch)), 48)
    driver = make_driver(path, num_page_override=120, admission="conservative",
                         schedule_conservativeness=0.1)
    for uid, prompt in enumerate(batch):
        driver.submit(uid, prompt, SamplingParams(max_tokens=48))
    driver.run()
    assert driver.stats.retractions == 0 and driver.ratio is None
    assert [driver.tokens(u) for u in range(len(batch))] == expected


@pytest.mark.parametrize(("config", "message"), [
    ({"admission": "greedy"}, "admission must be 'expected' .* or 'conservative'"),
    ({"schedule_conservativeness": 0.0}, "schedule_conservativeness must be a number above 0"),
    ({"schedule_conservativeness": float("nan")}, "raise it if requests are retracted often"),
])
def test_bad_settings_are_refused(config: dict, message: str,
                                  model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(model_path=str(model_dir("tiny-qwen3")), **config)


def test_server_flags(model_dir: Callable[[str], Path],
                      capsys: pytest.CaptureFixture[str]) -> None:
    model = str(model_dir("tiny-qwen3"))
    args = parse_args(["--model", model])
    assert (args.scheduler.admission, args.scheduler.schedule_conservativeness) == (
        "expected", 1.0)
    args = parse_args(["--model", model, "--admission", "conservative",
                       "--schedule-conservativeness", "1.5"])
    assert (args.scheduler.admission, args.scheduler.schedule_conservativeness) == (
        "conservative", 1.5)
    with pytest.raises(SystemExit):
        parse_args(["--model", model, "--schedule-conservativeness", "-1"])
    assert "--schedule-conservativeness must be a number above 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", model, "--admission", "greedy"])
    assert "choose from 'expected', 'conservative'" in capsys.readouterr().err
