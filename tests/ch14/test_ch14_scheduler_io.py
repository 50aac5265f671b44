"""Chapter 14: the scheduler behind sockets. It gives HF's tokens with finish reasons, answers
every request exactly once (errors included, at once), frees a request's row and pages wherever
an abort finds it, and exits cleanly on ExitMsg or SIGTERM."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.message import (
    AbortBackendMsg,
    BatchBackendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    UserMsg,
)
from minisgl.message.transport import IpcNamespace, ZmqPullQueue, ZmqPushQueue
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.io import ServerScheduler, scheduler_worker
from minisgl.scheduler.scheduler import ABORT_MARK_TTL_S
from minisgl.utils.device import stream_context

from reference import hf_greedy

PROMPTS = [[5, 80, 200, 31, 7, 99], [260, 18, 44], list(range(40, 100)), [3, 3, 3, 9]]


class Harness:
    """A ServerScheduler in this process, and the two sockets the tokenizer would hold."""

    def __init__(self, path: Path, overlap: bool, **config: object) -> None:
        os.environ["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "0" if overlap else "1"
        self.ns = IpcNamespace()
        cfg = SchedulerConfig(model_path=str(path), dtype=torch.float32, num_page_override=256,
                              **config)  # type: ignore[arg-type]
        self.from_sched = ZmqPullQueue(self.ns.addr("detok"), bind=True, expected=BatchTokenizerMsg)
        self.sched = ServerScheduler(cfg, self.ns.addr("sched"), self.ns.addr("detok"))
        self.to_sched = ZmqPushQueue[BatchBackendMsg](self.ns.addr("sched"), bind=False)
        self.data = None
        self.tokens: dict[int, list[int]] = {}
        self.ends: dict[int, list[DetokenizeMsg]] = {}
        self.log: list[DetokenizeMsg] = []  # every message, in order

    def send(self, *msgs: UserMsg | AbortBackendMsg | ExitMsg) -> None:
        self.to_sched.put(BatchBackendMsg(list(msgs)))
        assert self.sched.inbox.socket.poll(10_000)  # arrived: the next step will read it

    def step(self) -> None:
        """One turn of the scheduler's loop (whichever run_forever would use), then collect.
        Skipped when the loop would block: idle, with nothing in flight and nothing sent."""
        busy = self.sched.runnable or self.data is not None or not self.sched.inbox.empty()
        if busy:
            self._turn()
        # idle: what it sent may still be on the way (delivery is asynchronous)
        self.collect(0 if busy else 100)

    def collect(self, wait_ms: int) -> None:
        """File what the scheduler sent, waiting up to wait_ms for the first frame."""
        while (batch := self.from_sched.get(timeout_ms=wait_ms)) is not None:
            wait_ms = 0
            self.log += batch.data
            for m in batch.data:
                if m.next_token >= 0:
                    self.tokens.setdefault(m.uid, []).append(m.next_token)
                if m.finished:
                    self.ends.setdefault(m.uid, []).append(m)

    @torch.inference_mode()
    def _turn(self) -> None:
        with stream_context(self.sched.engine.stream):
            if self.sched.overlap:
                self.data = self.sched.overlap_loop(self.data)
            else:
                self.sched.normal_loop()

    def run_until(self, uids: set[int], max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if uids <= set(self.ends):
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {uids - set(self.ends)}")

    def check_all_returned(self) -> None:
        """Idle: every table row free, every page free or in the prefix cache."""
        assert not self.sched.runnable and not self.sched.aborted
        assert self.sched.table_manager.available_size == self.sched.config.max_running_req
        self.sched.cache_manager.check_integrity()

    def close(self) -> None:
        self.to_sched.close()
        self.from_sched.close()
        self.sched.shutdown()
        self.ns.remove()
        os.environ.pop("MINISGL_DISABLE_OVERLAP_SCHEDULING", None)


@pytest.fixture
def harness(model_dir: Callable[[str], Path]) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(overlap: bool = True, arch: str = "tiny-qwen3", **config: object) -> Harness:
        made.append(Harness(model_dir(arch), overlap, **config))
        return made[-1]

    yield make
    for h in made:
        h.close()


def user(uid: int, prompt: list[int], max_tokens: int = 8, **kw: object) -> UserMsg:
    return UserMsg(uid, torch.tensor(prompt, dtype=torch.int32),
                   SamplingParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("arch,overlap,cache", [
    ("tiny-qwen3", True, "radix"), ("tiny-qwen3", False, "radix"),
    ("tiny-qwen2", True, "naive"), ("tiny-mistral", False, "naive")])
def test_served_tokens_equal_hf_with_finish_reasons(harness: Callable[..., Harness],
                                                     model_dir: Callable[[str], Path],
                                                     arch: str, overlap: bool, cache: str) -> None:
    h = harness(overlap=overlap, arch=arch, cache_type=cache)
    h.send(*[user(i, p) for i, p in enumerate(PROMPTS)])
    h.run_until(set(range(len(PROMPTS))))
    path = model_dir(arch)
    for i, p in enumerate(PROMPTS):
        assert h.tokens[i] == hf_greedy(path, p, 8)[0]
        [end] = h.ends[i]  # exactly one last message
        assert end.finish_reason == "length" and end.error is None
    h.check_all_returned()


def test_eos_finishes_with_stop(harness: Callable[..., Harness],
                                model_dir: Callable[[str], Path]) -> None:
    """Make the model's first greedy token the EOS: the request ends there with "stop"."""
    h = harness()
    path = model_dir("tiny-qwen3")
    first = hf_greedy(path, PROMPTS[0], 1)[0][0]
    h.sched.eos_token_id = first
    h.send(user(0, PROMPTS[0]), user(1, PROMPTS[0], ignore_eos=True))
    h.run_until({0, 1})
    assert h.tokens[0] == [first] and h.ends[0][0].finish_reason == "stop"
    assert len(h.tokens[1]) == 8 and h.ends[1][0].finish_reason == "length"


def test_bad_requests_are_answered_at_once_and_the_loop_goes_on(
        harness: Callable[..., Harness]) -> None:
    h = harness()
    too_long = list(range(h.sched.max_seq_len))
    h.send(user(1, []), user(2, too_long), user(3, [5, 10**6]), user(4, PROMPTS[1]))
    h.step()  # one step: the three errors are out before any forward pass of theirs
    while len(h.ends) < 3:  # sent in that step; delivery may lag
        h.collect(10_000)
    assert {u: e[0].finish_reason for u, e in h.ends.items()} == {1: "error", 2: "error",
                                                                   3: "error"}
    assert "empty" in h.ends[1][0].error and "at most" in h.ends[2][0].error
    assert "token ids must be in" in h.ends[3][0].error
    h.run_until({4})
    assert h.ends[4][0].finish_reason == "length"
    h.check_all_returned()


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_frees_everything_wherever_it_finds_the_request(
        harness: Callable[..., Harness], overlap: bool) -> None:
    """Waiting (no row free), chunked (half its prompt computed), running, finished, and an
    abort that overtakes its request: each ends with exactly one message, and afterwards every
    row and page is back."""
    h = harness(overlap=overlap, max_running_req=3, max_extend_tokens=16, cache_type="radix")
    h.send(user(0, PROMPTS[2], max_tokens=30),  # 60 tokens: prefilled in chunks of 16
           user(1, PROMPTS[0], max_tokens=30), user(2, PROMPTS[1], max_tokens=30),
           user(3, PROMPTS[3], max_tokens=30))  # waits: no table row free
    h.step()
    h.step()
    assert any(p.uid == 0 and p.chunked_req for p in h.sched.prefill_manager.pending)
    h.send(AbortBackendMsg(0), AbortBackendMsg(3))  # chunked, and still waiting
    for _ in range(3):
        h.step()
    assert 1 in h.sched.decode_manager.running
    h.send(AbortBackendMsg(1), AbortBackendMsg(7))  # running; 7 is not here yet
    h.run_until({0, 1, 3})
    h.send(user(7, PROMPTS[0]))  # its abort came first: it never runs
    h.run_until({2, 7})
    h.send(AbortBackendMsg(2))  # already finished: nothing happens
    for _ in range(3):
        h.step()
    reasons = {u: [e.finish_reason for e in ends] for u, ends in h.ends.items()}
    assert reasons == {0: ["abort"], 1: ["abort"], 2: ["length"], 3: ["abort"], 7: ["abort"]}
    assert 0 not in h.tokens and 3 not in h.tokens and 7 not in h.tokens
    assert len(h.tokens[2]) == 30 and 0 < len(h.tokens[1]) < 30
    h.check_all_returned()


def test_an_abort_while_the_eos_batch_is_in_flight(harness: Callable[..., Harness],
                                                   model_dir: Callable[[str], Path]) -> None:
    """With overlap, the batch that will sample a request's EOS is already running when the
    abort comes: the request must still end once, with nothing after its last message."""
    h = harness(overlap=True)
    first, second = hf_greedy(model_dir("tiny-qwen3"), PROMPTS[0], 2)[0]
    h.sched.eos_token_id = second
    h.send(user(0, PROMPTS[0]))
    h.step()  # the prefill is launched
    h.step()  # the decode that samples the EOS is launched; the prefill's token goes out
    while 0 not in h.tokens:
        h.collect(10_000)
    assert h.tokens[0] == [first] and h.data is not None
    h.send(AbortBackendMsg(0))
    h.run_until({0})
    for _ in range(3):
        h.step()
    [end] = h.ends[0]
    assert end.finish_reason == "abort" and h.log[-1] is end  # nothing after the last message
    h.check_all_returned()


def test_a_late_abort_leaves_no_mark_for_ever(harness: Callable[..., Harness],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort for a request that finished steps ago looks like one that overtook its
    request; its mark must not stay for ever (a disconnect just after the end sends one)."""
    h = harness()
    h.send(user(0, PROMPTS[1], max_tokens=2))
    h.run_until({0})
    h.send(user(1, PROMPTS[0], max_tokens=2))  # later batches: 0 is out of finished_reqs
    h.run_until({1})
    h.sched.abort_req(0)
    assert 0 in h.sched.aborted  # it cannot tell "finished long ago" from "not here yet"
    clock = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: clock + ABORT_MARK_TTL_S)
    h.sched.abort_req(99)  # any later abort sweeps the expired marks
    assert 0 not in h.sched.aborted and 99 in h.sched.aborted


def test_offline_llm_and_server_share_one_loop() -> None:
    """Only the I/O hooks are overridden: the loop itself is the Scheduler's."""
    for name in ("normal_loop", "overlap_loop", "run_forever", "abort_req", "add_req"):
        assert getattr(ServerScheduler, name) is getattr(LLM, name)
    for hook in ("receive_reqs", "send_result"):
        assert getattr(ServerScheduler, hook) is not getattr(LLM, hook)


@pytest.mark.parametrize("how", ["exit-msg", "sigterm"])
def test_scheduler_process_exits_cleanly(model_dir: Callable[[str], Path], how: str) -> None:
    ns = IpcNamespace()
    cfg = SchedulerConfig(model_path=str(model_dir("tiny-qwen3")), dtype=torch.float32,
                          num_page_override=64)
    ready_recv, ready_send = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(
        target=scheduler_worker, args=(cfg, ns.addr("sched"), ns.addr("detok"), ready_send))
    try:
        with ZmqPullQueue(ns.addr("detok"), bind=True, expected=BatchTokenizerMsg) as pull, \
                ZmqPushQueue[BatchBackendMsg](ns.addr("sched"), bind=False) as push:
            proc.start()
            assert ready_recv.poll(120) and ready_recv.recv() == "scheduler"
            push.put(BatchBackendMsg([user(1, PROMPTS[1], max_tokens=4)]))
            got: list[DetokenizeMsg] = []
            while not (got and got[-1].finished):
                batch = pull.get(timeout_ms=60_000)
                assert batch is not None
                got += batch.data
            assert [m.next_token for m in got] == hf_greedy(model_dir("tiny-qwen3"),
                                                            PROMPTS[1], 4)[0]
            if how == "exit-msg":
                push.put(BatchBackendMsg([ExitMsg()]))
            else:
                os.kill(proc.pid, signal.SIGTERM)
            proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.kill()
        ns.remove()
    assert proc.exitcode == 0
