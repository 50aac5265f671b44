"""Chapter 22: random use of the real scheduler under KV pressure, extending the page machines of
chapters 7 and 9 with retraction. Requests of six prompts with random max_tokens arrive, steps
run, aborts come at any time (also while a request is retracted, or in the step that retracts
it); every step ends with each table row and KV page in exactly one place (the Driver checks),
and once drained every request has ended exactly once with its greedy output (or a prefix of it,
if aborted), and the scheduler is idle and whole."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from minisgl.core import SamplingParams

from driver import Driver, prompts, reference

PROMPTS = prompts(6, seed=5, lengths=(3, 20))
MAX_TOKENS = 32
# 96 KV tokens, 6 rows, prompts prefilled 8 tokens at a time, a low first guess of the output
CONFIG = {"num_page_override": 96, "max_running_req": 6, "max_extend_tokens": 8,
          "schedule_conservativeness": 0.1}


class RetractMachine(RuleBasedStateMachine):
    """One Driver for every example (set by the test), drained between them."""

    driver: Driver
    expected: list[list[int]]  # each prompt's output, to MAX_TOKENS or the test's EOS
    next_uid = 0

    def __init__(self) -> None:
        super().__init__()
        self.reqs: dict[int, tuple[int, int]] = {}  # uid -> (prompt, max_tokens)
        self.aborted: set[int] = set()

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, MAX_TOKENS),
          copies=st.integers(1, 4))
    def submit(self, prompt: int, max_tokens: int, copies: int) -> None:
        for _ in range(copies):
            uid = RetractMachine.next_uid
            RetractMachine.next_uid += 1
            self.reqs[uid] = (prompt, max_tokens)
            self.driver.submit(uid, PROMPTS[prompt], SamplingParams(max_tokens=max_tokens))

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            if self.driver.busy:
                self.driver.step()

    @rule()
    def drain(self) -> None:
        """Run until idle (the Driver checks that all came back): the ratio starts over."""
        self.driver.run()

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(u for u in self.reqs if self.driver.finish_reason(u) is None)
        if live:
            uid = data.draw(st.sampled_from(live), label="abort")
            self.aborted.add(uid)
            self.driver.abort(uid)


    def teardown(self) -> None:
        self.driver.run()  # drained: idle, every row and page back
        for uid, (prompt, max_tokens) in self.reqs.items():
            ends = [r for r in self.driver.replies.get(uid, []) if r.finished]
            assert len(ends) == 1, (uid, ends)
            want = self.expected[prompt][:max_tokens]
            got = self.driver.tokens(uid)
            if uid in self.aborted and ends[0].finish_reason == "abort":
                assert got == want[: len(got)], (uid, got, want)
            else:
                assert got == want, (uid, got, want)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_random_use_under_pressure(overlap: bool, page_size: int,
                                   model_dir: Callable[[str], Path],
                                   make_driver: Callable[..., Driver]) -> None:
    """30 examples of up to 30 rules, derandomized (16 or 17 retractions in all; at least 5
    must happen). Aborts of requests waiting again are rare here: test_ch22_retract.py pins
    them."""
    path = model_dir("tiny-qwen3")
    full = reference(path, tuple(map(tuple, PROMPTS)), MAX_TOKENS, ignore_eos=True)
    eos = full[0][3]  # an EOS that some outputs reach early
    expected = [out[: out.index(eos)] if eos in out else out for out in full]
    config = {**CONFIG, "num_page_override": CONFIG["num_page_override"] // page_size}
    driver = make_driver(path, overlap=overlap, page_size=page_size, **config)
    driver.eos_token_id = eos

    class Machine(RetractMachine):
        pass

    Machine.driver, Machine.expected = driver, expected
    run_state_machine_as_test(Machine, settings=settings(
        max_examples=30, stateful_step_count=30, derandomize=True, deadline=None,
        database=None))
    assert driver.stats.retractions >= 5
