"""Chapter 7: the scheduler and the offline LLM: continuous batching equals HF, requests join
and leave between steps, the token pool, and the page / row allocators under random use."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from minisgl.core import Req, SamplingParams
from minisgl.scheduler.cache import CacheManager, table_cells
from minisgl.scheduler.table import TableManager

from reference import hf_greedy, hf_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:",
           "Once upon a time, in a small village by the sea,", "Water boils at"]
MAX_TOKENS = [9, 4, 16, 12, 6]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_continuous_batching_equals_hf(name: str, model_dir, make_llm, caplog) -> None:
    """Five requests, at most two running: each output equals HF generating it alone."""
    path = model_dir(name)
    ids = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    llm = make_llm(path, max_running_req=2)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        outputs = llm.generate(PROMPTS, params)
    for x, out, n in zip(ids, outputs, MAX_TOKENS):
        assert out["token_ids"] == hf_greedy(path, x, n)[0]
    batches = [r.getMessage().split() for r in caplog.records if r.name.startswith("minisgl")]
    assert max(len(b) - 1 for b in batches) <= 2  # never more than max_running_req requests
    phases = [b[0] for b in batches]
    # continuous batching: new requests are prefilled between decode steps of running ones
    assert phases.count("prefill") >= 3 and phases.index("decode") < len(phases) - 1
    first_decode = phases.index("decode")
    assert "prefill" in phases[first_decode:]


def test_requests_join_and_leave(model_dir, make_llm, caplog) -> None:
    """A short request leaves, and a waiting one joins while a long one keeps decoding."""
    path = model_dir("tiny-qwen3")
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 2, 3)]
    llm = make_llm(path, max_running_req=2)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        llm.generate(PROMPTS[:3], params)
    steps = [r.getMessage().split() for r in caplog.records if r.name.startswith("minisgl")]
    uids = [[int(x.split("+")[0]) for x in s[1:]] for s in steps]
    assert steps[0][0] == "prefill" and uids[0] == [0, 1]
    joined = next(i for i, s in enumerate(steps) if s[0] == "prefill" and uids[i] == [2])
    assert all(0 in uids[i] for i in range(joined + 1, joined + 3))  # uid 0 never stopped
    assert 1 not in sum(uids[joined:], [])  # uid 1 had left


def test_token_ids_and_per_request_params(model_dir, make_llm) -> None:
    path = model_dir("tiny-llama")
    ids = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS[:2]]
    llm = make_llm(path)
    outputs = llm.generate(ids, [SamplingParams(max_tokens=5, ignore_eos=True),
                                 SamplingParams(max_tokens=3, ignore_eos=True)])
    assert [len(o["token_ids"]) for o in outputs] == [5, 3]
    assert outputs[0]["token_ids"] == hf_greedy(path, ids[0], 5)[0]
    assert outputs[1]["text"] == llm.tokenizer.decode(outputs[1]["token_ids"])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(ids, [SamplingParams()])


BAD_PROMPTS = [  # (prompts, what the ValueError says); tiny-qwen3 has 512 token ids
    ([[5, 6], 7], "prompt 1 must be a str or a list of token ids, got int"),
    ([[5, 6], None], "prompt 1 must be a str or a list of token ids, got NoneType"),
    ([[5, 512]], r"prompt 0: token 1 is 512; a token id is an int in \[0, 512\)"),
    (["ok", [5, -1]], r"prompt 1: token 1 is -1; a token id is an int in \[0, 512\)"),
    ([[5], [6], [7.0]], r"prompt 2: token 0 is 7.0; a token id is an int in \[0, 512\)"),
    ([[True]], r"prompt 0: token 0 is True; a token id is an int"),
]


def test_bad_prompts_are_refused_before_any_work(model_dir, make_llm) -> None:
    llm = make_llm(model_dir("tiny-qwen3"))
    assert llm.vocab_size == 512
    for prompts, message in BAD_PROMPTS:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="3 prompts but 2 SamplingParams"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])
    assert llm.stats.prefill_batches == 0  # nothing ran
    out = llm.generate([[5, 511], "ok"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert [len(o["token_ids"]) for o in out] == [2, 2]  # the LLM is still usable


def test_stops_at_eos_and_leaves_it_out(model_dir, make_llm) -> None:
    """Make the 4th greedy token the EOS id: generation stops there, without it."""
    path = model_dir("tiny-qwen3")
    ids = hf_tokenizer(path)(PROMPTS[0])["input_ids"]
    ref = hf_greedy(path, ids, 8)[0]
    llm = make_llm(path)
    llm.eos_token_id = ref[3]
    cut = ref.index(ref[3])  # the first occurrence is where it stops
    out = llm.generate([ids, ids], [SamplingParams(max_tokens=8),
                                    SamplingParams(max_tokens=8, ignore_eos=True)])
    assert out[0]["token_ids"] == ref[:cut]
    assert out[1]["token_ids"] == ref


def test_sampling_is_seeded(model_dir, make_llm) -> None:
    path = model_dir("tiny-qwen3")
    hot = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        llm = make_llm(path, seed=seed)
        runs.append([o["token_ids"] for o in llm.generate(PROMPTS[:2], hot)])
        llm.shutdown()
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_decode_batches_are_in_uid_order(model_dir, make_llm, caplog) -> None:
    """A decode batch lists the running requests by uid. The sampler draws for the whole batch
    at once, so a request's random numbers depend on its place in the batch: that place must
    follow from which requests run, not from how they happen to be stored."""
    path = model_dir("tiny-qwen3")
    hot = SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True)
    llm = make_llm(path, seed=7)
    with caplog.at_level(logging.DEBUG, logger="minisgl.scheduler"):
        llm.generate(PROMPTS[:4], hot)
    steps = [r.getMessage().split() for r in caplog.records if r.name.startswith("minisgl")]
    decodes = [[int(x.split("+")[0]) for x in s[1:]] for s in steps if s[0] == "decode"]
    assert decodes and all(uids == sorted(uids) for uids in decodes), decodes


def test_token_pool_holds_prompt_and_outputs(model_dir, make_llm) -> None:
    """The token pool row of a request holds its prompt, then each sampled token."""
    path = model_dir("tiny-qwen3")
    ids = hf_tokenizer(path)(PROMPTS[3])["input_ids"]
    llm = make_llm(path, max_running_req=1)
    out = llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]["token_ids"]
    # the 6th token is in the pool too (at len(ids) + 5), but no step reads it: compare 5
    row = llm.token_pool[0, : len(ids) + 5].tolist()
    assert row == ids + out[:5]


class PageMachine(RuleBasedStateMachine):
    """Random admissions, forward steps and finishes of fake requests, driving TableManager and
    CacheManager as the scheduler does; every page must be free or owned by one request."""

    cache_cls = CacheManager
    page_size = 4
    num_pages = 24

    def __init__(self) -> None:
        super().__init__()
        rows, cols = 5, 64
        self.page_table = torch.full((rows + 1, cols), -1, dtype=torch.int32)
        self.table = TableManager(rows, self.page_table)
        self.cache = self.cache_cls(self.num_pages, self.page_size, self.page_table)
        self.running: dict[int, Req] = {}
        self.uid = 0

    def _pages_of(self, req: Req) -> set[int]:
        ps = self.page_size
        n = -(-req.cached_len // ps) * ps
        return {int(s) // ps for s in self.page_table[req.table_idx, :n][::ps]}

    @rule(prompt_len=st.integers(1, 20), out_len=st.integers(1, 12))
    def admit(self, prompt_len: int, out_len: int) -> None:
        if not self.table.available_size:
            return
        row = self.table.allocate()
        req = Req(torch.zeros(prompt_len, dtype=torch.int32), row, 0, out_len, self.uid,
                  SamplingParams(max_tokens=out_len))
        self.uid += 1
        if -(-req.device_len // self.page_size) * self.page_size > self.cache.available_size:
            self.table.free(row)
            return
        self.cache.allocate_paged([req])
        req.complete_one()  # the prefill ran
        self.running[req.uid] = req

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        reqs = [r for r in self.running.values() if r.can_decode]
        reqs = [r for r in reqs if self.cache.available_size >= self.page_size]
        if not reqs:
            return
        req = data.draw(st.sampled_from(reqs))
        self.cache.allocate_paged([req])
        req.complete_one()

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if not self.running:
            return
        uid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(uid)
        self.table.free(req.table_idx)
        self.cache._free(self.page_table[req.table_idx, : req.cached_len])

    @invariant()
    def every_page_in_one_place(self) -> None:
        free = [int(s) // self.page_size for s in self.cache.free_slots.tolist()]
        owned = [p for r in self.running.values() for p in self._pages_of(r)]
        assert len(free) + len(owned) == self.num_pages, (len(free), len(owned))
        assert sorted(free + owned) == list(range(self.num_pages))
        assert self.table.available_size + len(self.running) == 5
        if not self.running:
            self.cache.check_integrity()


PageMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                         derandomize=True, deadline=None)
TestPageMachine = PageMachine.TestCase


class LeakyCache(CacheManager):
    """A planted bug: freeing forgets the last page of every run it is given."""

    def _free(self, slots: torch.Tensor) -> None:
        super()._free(slots[: -self.page_size])


def test_planted_leak_is_caught() -> None:
    class LeakyMachine(PageMachine):
        cache_cls = LeakyCache

    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeakyMachine, settings=settings(
            max_examples=60, stateful_step_count=40, derandomize=True, deadline=None,
            database=None))


def test_table_rows_cannot_be_freed_twice() -> None:
    table = TableManager(3, torch.zeros((4, 8), dtype=torch.int32))
    row = table.allocate()
    table.free(row)
    with pytest.raises(RuntimeError, match="freed twice"):
        table.free(row)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40), st.integers(0, 9)), max_size=8))
def test_table_cells_match_a_loop_over_cells(spans: list[tuple[int, int, int]]) -> None:
    rows, cols = table_cells(spans, torch.device("cpu"))
    expected = [(row, first + i) for row, first, length in spans for i in range(length)]
    assert rows.dtype == cols.dtype == torch.int64
    assert list(zip(rows.tolist(), cols.tolist())) == expected
