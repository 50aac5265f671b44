"""The CacheManager driven at random the way the scheduler drives it, checked after every step
that each page is in exactly one place: the machine of chapter 9's tests, which chapter 15's
extends with a salt per request."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minisgl.core import Req, SamplingParams
from minisgl.kvcache import BaseCacheHandle
from minisgl.kvcache.radix_cache import RadixPrefixCache
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.utils import PendingReq


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def slots_of(handle: BaseCacheHandle) -> list[int]:
    return handle.get_matched_indices().tolist()


@st.composite
def prompts(draw: st.DrawFn, stems: list[list[int]], max_tail: int) -> list[int]:
    """A cut of a shared stem plus a short random tail: prompts often share whole pages."""
    stem = draw(st.sampled_from(stems))
    tail = draw(st.binary(max_size=max_tail))
    return stem[: draw(st.integers(0, len(stem)))] + [byte % 4 for byte in tail] or [0]


class ManagerMachine(RuleBasedStateMachine):
    """Requests admitted, prefilled, decoded and finished the way the scheduler drives them.
    prefill admits 1 to 3 requests as PrefillAdder does (match, estimate, lock, re-check, a row),
    allocates their pages and calls cache_req(finished=False); decode moves every running request
    one step; stop_early ends one (an EOS). Prompts are cuts of shared stems plus short tails,
    often the very same prompt twice in one batch, and sampled tokens are 0 or 1, so outputs
    collide too. There is no deferral (that is PrefillManager's job), so a prefix is often found
    already cached only at insertion. Every page must be in exactly one place: free, in the cache,
    or owned by one request.

    A subclass picks the settings below and may hook `_pending` (how a request is made),
    `_matched` (what its cache match must satisfy) and `_allocated` (the pages it was given)."""

    manager_cls: type[CacheManager] = CacheManager
    page_sizes, cache_types = (1, 4), ("radix", "naive")
    rows, cols = 4, 32
    capacity = 32  # tokens: 32 pages of 1, or 8 pages of 4
    stems = [[0, 1, 2, 3, 0, 1, 2, 3, 1, 1, 0, 0], [0, 1, 2, 3, 3, 2, 1, 0, 2, 2, 2, 2],
             [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]]
    max_tail, max_out = 4, 8

    def __init__(self) -> None:
        super().__init__()
        self.ps = 1
        self.num_pages = self.capacity
        self.page_table = torch.zeros((self.rows, self.cols), dtype=torch.int32)
        self.mgr = self.manager_cls(self.num_pages, 1, self.page_table)
        self.free_rows = list(range(self.rows))
        self.running: dict[int, Req] = {}
        self.extent: dict[int, int] = {}  # uid -> positions of its row that have pages
        self.uid = 0

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        page_size = data.draw(st.sampled_from(self.page_sizes), label="page_size")
        cache_type = data.draw(st.sampled_from(self.cache_types), label="cache_type")
        self.ps, self.num_pages = page_size, self.capacity // page_size
        self.mgr = self.manager_cls(self.num_pages, page_size, self.page_table, cache_type)
        self.prefill(data, n=3)  # start with requests running, whichever rules run after

    def _pending(self, prompt: list[int], params: SamplingParams,
                 data: st.DataObject) -> PendingReq:
        return PendingReq(self.uid, ids(*prompt), params)

    def _matched(self, pending: PendingReq, handle: BaseCacheHandle) -> None:
        pass

    def _allocated(self, req: Req, start: int, end: int) -> None:
        pass

    def _reserved(self) -> int:
        """DecodeManager.inflight_tokens: what the running requests may still need."""
        return sum(r.remain_len + self.ps - 1 for r in self.running.values())

    def _forward(self, reqs: list[Req]) -> None:
        self.mgr.allocate_paged(reqs)
        for req in reqs:
            end = -(-req.device_len // self.ps) * self.ps
            self._allocated(req, req.cache_handle.cached_len, end)
            self.extent[req.uid] = end
            req.complete_one()

    def _sampled(self, reqs: list[Req], data: st.DataObject) -> None:
        """The tokens arrive: append them, and finish the requests out of budget."""
        tokens = data.draw(st.binary(min_size=len(reqs), max_size=len(reqs)), label="tokens")
        for req, token in zip(reqs, tokens):
            req.append_host(torch.tensor(token % 2))  # 0 or 1: outputs collide too
            if not req.can_decode:
                self._finish(req)

    def _finish(self, req: Req) -> None:
        del self.running[req.uid], self.extent[req.uid]
        self.free_rows.append(req.table_idx)
        self.mgr.cache_req(req, finished=True)

    @rule(data=st.data(), n=st.integers(1, 3))
    def prefill(self, data: st.DataObject, n: int) -> None:
        """Admit up to n requests into one batch, as PrefillAdder does, and run it."""
        reserved, batch = self._reserved(), []
        prompt: list[int] = []
        for _ in range(n):
            if not self.free_rows:
                break
            if not (prompt and data.draw(st.booleans(), label="same prompt again")):
                prompt = data.draw(prompts(self.stems, self.max_tail), label="prompt")
            out_len = data.draw(st.integers(1, self.max_out), label="output_len")
            params = SamplingParams(max_tokens=out_len, ignore_eos=True)
            pending = self._pending(prompt, params, data)
            handle = self.mgr.match_req(pending)
            self._matched(pending, handle)
            need = pending.input_len - handle.cached_len + out_len + self.ps - 1
            if need + reserved > self.mgr.available_size:
                break
            self.mgr.lock(handle)
            if need + reserved > self.mgr.available_size:
                self.mgr.unlock(handle)
                break
            row = self.free_rows.pop()
            self.page_table[row, : handle.cached_len] = handle.get_matched_indices()
            batch.append(Req(pending.input_ids, row, handle.cached_len, out_len, self.uid,
                             params, handle))
            reserved += need
            self.uid += 1
        if not batch:
            return
        self._forward(batch)
        for req in batch:
            self.running[req.uid] = req
            self.mgr.cache_req(req, finished=False)
        self._sampled(batch, data)

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        if not self.running:
            return
        batch = [self.running[uid] for uid in sorted(self.running)]
        self._forward(batch)
        self._sampled(batch, data)

    @rule(data=st.data())
    def stop_early(self, data: st.DataObject) -> None:
        """An EOS: the request finishes before its budget is used up."""
        if not self.running:
            return
        self._finish(self.running[data.draw(st.sampled_from(sorted(self.running)))])

    @invariant()
    def every_page_in_one_place(self) -> None:
        """Every cached node and every row is made of whole pages; a running request's row starts
        with exactly its handle's slots (the cache's pages: this is what the repointing in
        cache_req keeps true), then pages of its own; free, cached and owned pages together are
        0..num_pages-1, each once; what the running requests will still be given fits in
        available_size (admission control's promise); when idle, CacheManager.check_integrity
        passes."""
        ps, mgr = self.ps, self.mgr
        free = mgr.free_slots.tolist()
        assert all(s % ps == 0 for s in free), free
        free_pages = [s // ps for s in free]
        cached_pages: list[int] = []
        cache = mgr.prefix_cache
        if isinstance(cache, RadixPrefixCache):
            for node in cache._nodes():
                values = node.value.tolist()
                assert all(v == values[i - i % ps] + i % ps for i, v in enumerate(values))
                cached_pages += [s // ps for s in values[::ps]]
        assert len(cached_pages) * ps == cache.size_info.total_size
        cached = set(cached_pages)
        owned: list[int] = []
        for req in self.running.values():
            handle, end = req.cache_handle, self.extent[req.uid]
            row = self.page_table[req.table_idx, :end].tolist()
            assert all(v == row[i - i % ps] + i % ps for i, v in enumerate(row))
            n = handle.cached_len
            assert row[:n] == slots_of(handle)  # the locked prefix: the cache's pages
            assert {s // ps for s in row[:n:ps]} <= cached
            owned += [s // ps for s in row[n::ps]]  # beyond it: pages of its own
        assert len(free_pages) + len(cached_pages) + len(owned) == self.num_pages, (
            len(free_pages), len(cached_pages), len(owned))
        assert sorted(free_pages + cached_pages + owned) == list(range(self.num_pages))
        # what the running requests will still be given fits in what is free or evictable
        future = sum(-(-(r.max_device_len - 1) // ps) * ps - self.extent[r.uid]
                     for r in self.running.values())
        assert mgr.available_size >= future
        if not self.running:
            mgr.check_integrity()
