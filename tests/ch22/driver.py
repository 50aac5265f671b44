"""What chapter 22's tests share: an offline scheduler stepped by hand (requests and aborts
arrive between steps, every reply is kept), which checks after every step that each table row and
each KV page is in exactly one place; greedy reference outputs from a pool that never retracts;
the retraction events the scheduler logged."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache.radix_cache import RadixPrefixCache
from minisgl.llm import LLM
from minisgl.scheduler.prefill import ChunkedReq
from minisgl.scheduler.utils import PendingReq, TokenReply
from minisgl.utils.device import stream_context

RETRACT_LOG = re.compile(r"retracted (\d+) request\(s\) \(uids ([\d ]+)\)")


def prompts(n: int, seed: int = 22, lengths: tuple[int, int] = (4, 14)) -> list[list[int]]:
    """n random prompts of lengths[0]..lengths[1]-1 token ids, the same on every call."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (n,), generator=g).tolist()
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in sizes]


@cache
def reference(path: Path, batch: tuple[tuple[int, ...], ...], max_tokens: int,
              page_size: int = 1, ignore_eos: bool = False) -> list[list[int]]:
    """Greedy outputs (the model's EOS ends a request unless ignore_eos) from a pool far larger
    than the batch needs, admitted conservatively: nothing is ever retracted."""
    llm = LLM(str(path), dtype=torch.float32, num_page_override=8192,
              page_size=page_size, admission="conservative")
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        out = llm.generate([list(p) for p in batch], params)
        assert llm.stats.retractions == 0
        return [list(o["token_ids"]) for o in out]  # type: ignore[arg-type]
    finally:
        llm.shutdown()


def early_stopping(path: Path, n: int = 64) -> tuple[int, list[list[int]], list[list[int]]]:
    """A workload whose requests end long before max_tokens, deterministically: of n random
    prompts, those whose greedy output (8 tokens) has one common token, the most frequent such,
    at positions 1-6. With that token as EOS they stop after 1-6 tokens. Returns the token, the
    prompts and their outputs up to it."""
    candidates = prompts(n, seed=7, lengths=(5, 12))
    outs = reference(path, tuple(map(tuple, candidates)), 8)
    counts: dict[int, int] = {}
    for out in outs:
        for token in set(out[1:7]) - {out[0]}:
            counts[token] = counts.get(token, 0) + 1
    eos = max(sorted(counts), key=lambda t: counts[t])
    chosen = [(p, o[: o.index(eos)]) for p, o in zip(candidates, outs)
              if eos in o[1:7] and o[0] != eos]
    return eos, [p for p, _ in chosen], [o for _, o in chosen]


def retracted_uids(caplog: pytest.LogCaptureFixture) -> list[list[int]]:
    """The uids of each retraction event the scheduler logged, in order."""
    out = []
    for record in caplog.records:
        if (m := RETRACT_LOG.search(record.getMessage())) is not None:
            uids = [int(u) for u in m.group(2).split()]
            assert len(uids) == int(m.group(1))
            out.append(uids)
    return out


class Driver(LLM):
    """The offline LLM's scheduler, stepped by hand: `submit` and `abort` take effect at the
    next step's receive (as the server's messages do), every TokenReply is kept per uid, and
    after every step (unless `check` is off) every table row and KV page must be in exactly one
    place. Hooks run before and after each step."""

    def __init__(self, path: Path, **config: object) -> None:
        super().__init__(str(path), **config)
        self.inbox: list[PendingReq] = []
        self.abort_inbox: list[int] = []
        self.replies: dict[int, list[TokenReply]] = {}
        self.data = None  # the batch in flight (overlap)
        self.steps = 0
        self.check = True
        self.before_step: list[Callable[[Driver], None]] = []
        self.after_step: list[Callable[[Driver], None]] = []

    def submit(self, uid: int, prompt: list[int], params: SamplingParams) -> None:
        self.inbox.append(PendingReq(uid, torch.tensor(prompt, dtype=torch.int32), params))

    def abort(self, uid: int) -> None:
        self.abort_inbox.append(uid)

    def receive_reqs(self, blocking: bool) -> list[PendingReq]:
        for uid in self.abort_inbox:
            self.abort_req(uid)
        reqs, self.inbox, self.abort_inbox = self.inbox, [], []
        return reqs

    def send_result(self, replies: list[TokenReply]) -> None:
        for r in replies:
            got = self.replies.setdefault(r.uid, [])
            assert not (got and got[-1].finished), f"request {r.uid}: a reply after its end"
            got.append(r)

    @property
    def in_flight(self) -> list[Req] | None:
        """The requests of the batch in flight (overlap), None if there is none."""
        return None if self.data is None else self.data[0].batch.reqs

    @property
    def busy(self) -> bool:
        return self.runnable or self.data is not None or bool(self.inbox or self.abort_inbox)

    @torch.inference_mode()
    def step(self) -> None:
        for hook in self.before_step:
            hook(self)
        with stream_context(self.engine.stream):
            if self.overlap:
                self.data = self.overlap_loop(self.data)
            else:
                self.normal_loop()
        self.steps += 1
        if self.check:
            check_conservation(self, self.in_flight)
        for hook in self.after_step:
            hook(self)

    def step_until(self, done: Callable[[Driver], bool], max_steps: int = 1000) -> None:
        """Step until done(self), failing after max_steps."""
        for _ in range(max_steps):
            if done(self):
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def run(self, max_steps: int = 2000) -> None:
        """Step until idle, then check that everything came back."""
        for _ in range(max_steps):
            if not self.busy:
                check_idle(self)
                return
            self.step()
        raise AssertionError(f"still busy after {max_steps} steps")

    def tokens(self, uid: int) -> list[int]:
        return [r.next_token for r in self.replies.get(uid, []) if r.next_token >= 0
                and not (r.finished and r.finish_reason == "stop")]

    def finish_reason(self, uid: int) -> str | None:
        got = self.replies.get(uid)
        return got[-1].finish_reason if got and got[-1].finished else None


def holders(sched: LLM, in_flight: list[Req] | None) -> list[Req]:
    """The requests that hold a table row and KV pages: running, part-way through a chunked
    prefill, or in the batch in flight and not yet given back (length-finished ones left the
    running set at launch but keep their row until their last token is processed)."""
    out: dict[int, Req] = {id(r): r for r in sched.decode_manager.running.values()}
    out.update({id(p.chunked_req): p.chunked_req for p in sched.prefill_manager.pending
                if p.chunked_req is not None})
    for r in in_flight or []:
        if not isinstance(r, ChunkedReq) and r not in sched.finished_reqs \
                and r not in sched.retracted:
            out[id(r)] = r
    return list(out.values())


def check_conservation(sched: LLM, in_flight: list[Req] | None) -> None:
    """Rows: free + held + waiting to be freed (retracted) = all. Pages: free, in the prefix
    cache, or owned by one holder beyond its locked cached prefix, each exactly once."""
    reqs = holders(sched, in_flight)
    table, cache, ps = sched.table_manager, sched.cache_manager, sched.config.page_size
    rows = [r.table_idx for r in reqs] + [r.table_idx for r in sched.retracted]
    assert len(set(rows)) == len(rows), f"a row held twice: {sorted(rows)}"
    assert table.available_size + len(rows) == sched.config.max_running_req, (
        f"rows: {table.available_size} free + {len(rows)} held != {sched.config.max_running_req}")
    free = [s // ps for s in cache.free_slots.tolist()]
    cached: list[int] = []
    if isinstance(cache.prefix_cache, RadixPrefixCache):
        for node in cache.prefix_cache._nodes():
            cached += [s // ps for s in node.value.tolist()[::ps]]
    owned: list[int] = []
    for r in reqs:
        assert r.cache_handle is not None
        start, end = r.cache_handle.cached_len, -(-r.cached_len // ps) * ps
        owned += [s // ps for s in sched.engine.page_table[r.table_idx, start:end:ps].tolist()]
    assert sorted(free + cached + owned) == list(range(cache.num_pages)), (
        f"pages: {len(free)} free + {len(cached)} cached + {len(owned)} owned "
        f"({len(set(free + cached + owned))} distinct) != {cache.num_pages}")


def check_idle(sched: Driver) -> None:
    """Nothing left anywhere: every row free, every page free or cached, the ratio back at its
    start, and no abort mark but those of requests that had ended when their abort came (such
    a mark waits for ABORT_MARK_TTL_S: it looks like an abort that overtook its request)."""
    assert not sched.runnable and not sched.retracted
    assert all(sched.finish_reason(uid) is not None for uid in sched.aborted), sched.aborted
    assert sched.table_manager.available_size == sched.config.max_running_req
    sched.cache_manager.check_integrity()
    assert sched.new_token_ratio == (1.0 if sched.ratio is None else sched.ratio.init)
