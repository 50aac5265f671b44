"""Chapter 22: retraction. With a KV pool far too small for the requests' max_tokens, admitted by
expected need, the scheduler retracts requests and recomputes them later; every client still
gets exactly the greedy tokens a pool that never retracts gives, rows and pages are conserved
after every step, aborts find retracted requests, and a retracted request goes first."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from minisgl.core import Batch, SamplingParams

from driver import Driver, prompts, reference, retracted_uids

MODELS = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
NUM_REQS, MAX_TOKENS = 20, 64
POOL = 160  # KV tokens: two of the requests at their full length, and a bit
# a low guess of the output still to come: the scheduler over-commits the pool, and must retract
PRESSURE = {"schedule_conservativeness": 0.1, "max_running_req": 16}


def run_batch(driver: Driver, batch: list[list[int]], max_tokens: int = MAX_TOKENS,
              ) -> list[list[int]]:
    for uid, prompt in enumerate(batch):
        driver.submit(uid, prompt, SamplingParams(max_tokens=max_tokens))
    driver.run()
    assert all(driver.finish_reason(uid) in ("stop", "length") for uid in range(len(batch)))
    return [driver.tokens(uid) for uid in range(len(batch))]


def check_retracted_and_equal(driver: Driver, batch: list[list[int]], out: list[list[int]],
                              expected: list[list[int]], caplog: pytest.LogCaptureFixture,
                              ) -> None:
    """Retractions happened (the test cannot pass vacuously), each request was retracted a
    few times at most, and the outputs are the never-retracting pool's."""
    events = retracted_uids(caplog)
    assert driver.stats.retractions == len(events) > 0
    assert driver.stats.retracted_reqs == sum(map(len, events))
    assert driver.stats.recomputed_tokens > 0
    per_request = [sum(uids.count(u) for uids in events) for u in range(len(batch))]
    assert max(per_request) <= 3, per_request
    assert out == expected


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_retraction_keeps_greedy_outputs(name: str, overlap: bool, page_size: int,
                                         model_dir: Callable[[str], Path],
                                         make_driver: Callable[..., Driver],
                                         caplog: pytest.LogCaptureFixture) -> None:
    path = model_dir(name)
    batch = prompts(NUM_REQS)
    expected = reference(path, tuple(map(tuple, batch)), MAX_TOKENS, page_size)
    driver = make_driver(path, overlap=overlap, page_size=page_size,
                         num_page_override=POOL // page_size, cache_type="radix", **PRESSURE)
    with caplog.at_level(logging.INFO, logger="minisgl.scheduler"):
        out = run_batch(driver, batch)
    check_retracted_and_equal(driver, batch, out, expected, caplog)


def test_retraction_keeps_greedy_outputs_on_smollm2(model_dir: Callable[[str], Path],
                                                    make_driver: Callable[..., Driver],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A real model's vocabulary and weights, once (about 5 s): overlap, pages of 4, a pool of
    48 tokens for five requests of up to 16 output tokens."""
    path = model_dir("SmolLM2-135M-Instruct")
    batch = prompts(5)
    expected = reference(path, tuple(map(tuple, batch)), 16, 4)
    driver = make_driver(path, overlap=True, page_size=4, num_page_override=12, **PRESSURE)
    with caplog.at_level(logging.INFO, logger="minisgl.scheduler"):
        out = run_batch(driver, batch, max_tokens=16)
    check_retracted_and_equal(driver, batch, out, expected, caplog)


def pressure_driver(make_driver: Callable[..., Driver], path: Path, overlap: bool,
                    batch: list[list[int]]) -> Driver:
    """The first test's workload on tiny-qwen3, pages of 1, submitted (not yet run)."""
    driver = make_driver(path, overlap=overlap, num_page_override=POOL, **PRESSURE)
    for uid, prompt in enumerate(batch):
        driver.submit(uid, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    return driver


def requeued(driver: Driver) -> list[int]:
    """The uids waiting again after a retraction."""
    return [p.uid for p in driver.prefill_manager.pending if p.retractions]


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_while_retracted(overlap: bool, model_dir: Callable[[str], Path],
                               make_driver: Callable[..., Driver]) -> None:
    """Right after its retraction the request waits in the queue, holding nothing (its row
    waits only for the batch in flight): an abort then ends it with one message, and nothing
    is freed twice. The others are not disturbed."""
    path = model_dir("tiny-qwen3")
    batch = prompts(NUM_REQS)
    expected = reference(path, tuple(map(tuple, batch)), MAX_TOKENS)
    driver = pressure_driver(make_driver, path, overlap, batch)
    driver.step_until(lambda d: bool(requeued(d)))
    [victim] = requeued(driver)
    sent = driver.tokens(victim)
    assert driver.finish_reason(victim) is None and sent == expected[victim][: len(sent)]
    driver.abort(victim)
    driver.run()
    assert [r.finish_reason for r in driver.replies[victim] if r.finished] == ["abort"]
    assert driver.tokens(victim) == sent
    assert all(driver.tokens(u) == expected[u] for u in range(NUM_REQS) if u != victim)


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_of_the_victim_in_the_batch_in_flight(overlap: bool,
                                                    model_dir: Callable[[str], Path],
                                                    make_driver: Callable[..., Driver]) -> None:
    """The abort arrives in the very step that retracts its request, while (with overlap) the
    batch in flight still computes the request's next token: the request is answered once,
    "abort", that token is never sent, and its row and pages come back once. A first run finds
    the step and the victim; the second, identical up to then, sends the abort."""
    path = model_dir("tiny-qwen3")
    batch = prompts(NUM_REQS)
    expected = reference(path, tuple(map(tuple, batch)), MAX_TOKENS)
    probe = pressure_driver(make_driver, path, overlap, batch)
    in_flight: list[list[int]] = []  # before each step
    probe.before_step.append(lambda d: in_flight.append([r.uid for r in d.in_flight or []]))
    probe.step_until(lambda d: bool(requeued(d)))
    [victim], step = requeued(probe), probe.steps
    assert (victim in in_flight[-1]) == overlap  # without overlap nothing is in flight
    probe.shutdown()
    driver = pressure_driver(make_driver, path, overlap, batch)
    driver.step_until(lambda d: d.steps == step - 1)
    sent = driver.tokens(victim)
    driver.abort(victim)
    driver.step()  # receives the abort, then retracts the request
    assert victim not in requeued(driver) and driver.stats.retracted_reqs == 1
    driver.run()
    assert [r.finish_reason for r in driver.replies[victim] if r.finished] == ["abort"]
    assert driver.tokens(victim) == sent == expected[victim][: len(sent)]
    assert all(driver.tokens(u) == expected[u] for u in range(NUM_REQS) if u != victim)


def test_retracted_requests_go_before_a_sustained_stream(model_dir: Callable[[str], Path],
                                                         make_driver: Callable[..., Driver],
                                                         caplog: pytest.LogCaptureFixture,
                                                         ) -> None:
    """A new request arrives every step for 150 steps, more than the pool serves, so a queue
    builds up. A retracted request must not wait behind it: it is admitted again no later than
    every request that was waiting when it was retracted. Every request finishes with its
    greedy output, each retracted at most three times."""
    path = model_dir("tiny-qwen3")
    batch = prompts(150, seed=9)
    expected = reference(path, tuple(map(tuple, batch)), 24)
    driver = make_driver(path, num_page_override=POOL, **PRESSURE)
    waiting: dict[int, list[int]] = {}  # step -> uids waiting at its end, in order
    driver.after_step.append(
        lambda d: waiting.setdefault(d.steps, [p.uid for p in d.prefill_manager.pending]))
    with caplog.at_level(logging.INFO, logger="minisgl.scheduler"):
        for uid, prompt in enumerate(batch):
            driver.submit(uid, prompt, SamplingParams(max_tokens=24))
            driver.step()
        driver.run()
    assert [driver.tokens(u) for u in range(len(batch))] == expected
    events = retracted_uids(caplog)
    assert len(events) >= 3
    counts = {u: sum(e.count(u) for e in events) for u in range(len(batch))}
    assert max(counts.values()) <= 3
    steps = sorted(waiting)

    def admitted_after(uid: int, step: int) -> int:
        """The first step after `step` at whose end `uid` no longer waits."""
        return next(s for s in steps if s > step and uid not in waiting[s])

    checked = 0
    for step in steps:
        victims = [u for u in waiting[step] if step - 1 in waiting
                   and u not in waiting[step - 1] and u < step - 1]  # back in the queue
        for v in victims:
            for w in waiting[step]:
                if w not in victims:
                    assert admitted_after(v, step) <= admitted_after(w, step), (v, w, step)
                    checked += 1
    assert checked > 0  # some request was waiting when one was retracted


def test_a_request_that_cannot_fit_alone_fails_with_a_reason(model_dir: Callable[[str], Path],
                                                             make_driver: Callable[..., Driver],
                                                             caplog: pytest.LogCaptureFixture,
                                                             ) -> None:
    """max_seq_len makes this impossible, so it is planted: every available page is taken
    away while one request runs. It ends with an error that says the KV pool is too small (the
    server answers it as finish_reason "error"); once the pages are given back, everything is."""
    driver = make_driver(model_dir("tiny-qwen3"), num_page_override=64)
    driver.submit(0, [5, 6, 7], SamplingParams(max_tokens=30))
    for _ in range(3):
        driver.step()
    driver.check = False  # the stolen pages are nobody's
    cache = driver.cache_manager
    stolen = cache._allocate(cache.available_size // cache.page_size)
    with caplog.at_level(logging.ERROR, logger="minisgl.scheduler"):
        driver.step_until(lambda d: d.finish_reason(0) is not None)
    end = driver.replies[0][-1]
    assert end.finish_reason == "abort" and end.next_token == -1
    assert end.error is not None and "KV pool is too small for this request alone" in end.error
    assert "request 0 fails: the KV pool is too small" in caplog.text
    assert 0 < len(driver.tokens(0)) < 30
    cache._free(stolen)
    driver.check = True
    driver.run()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_decode_turn_between_chunks_waits_for_the_promised_pages(
        overlap: bool, model_dir: Callable[[str], Path],
        make_driver: Callable[..., Driver]) -> None:
    """The server decodes between the chunks of a long prompt. That prompt was admitted with
    its pages promised; running requests admitted by expected need may want them too. When the
    rest does not fit, the decode waits (the chunk goes on) rather than take them: the
    chunk never runs out of pages, and every output is still the reference's."""
    path = model_dir("tiny-qwen3")
    shorts = prompts(3, seed=3)
    long = prompts(1, seed=4, lengths=(40, 41))[0]
    expected = (reference(path, tuple(map(tuple, shorts)), 40)
                + reference(path, (tuple(long),), 2))
    driver = make_driver(path, overlap=overlap, num_page_override=96, max_extend_tokens=4,
                         schedule_conservativeness=0.1)
    driver.decode_between_chunks = True  # the server's policy
    waits = []  # decode turns that found running requests and gave the step to the chunk
    schedule_decode = driver._schedule_decode

    def spy() -> Batch | None:
        batch = schedule_decode()
        waits.append(batch is None and driver.decode_manager.runnable)
        return batch

    driver._schedule_decode = spy  # type: ignore[method-assign]
    for uid, prompt in enumerate(shorts):
        driver.submit(uid, prompt, SamplingParams(max_tokens=40))
    for _ in range(3):
        driver.step()
    driver.submit(3, long, SamplingParams(max_tokens=2))
    driver.run()
    assert [driver.tokens(u) for u in range(4)] == expected
    assert driver.stats.retractions > 0 and sum(waits) > 0
