"""PrefillManager and PrefillAdder (chapter 7): which waiting requests join the next prefill
batch, within the budgets, with prefix matching and prompts in chunks."""

from __future__ import annotations

import torch

from minisgl.core import Batch, Req
from minisgl.kvcache import BaseCacheHandle
from minisgl.kvcache.radix_cache import match_len

from .cache import CacheManager
from .decode import DecodeManager
from .table import TableManager
from .utils import PendingReq

# a request that shares this many more tokens with a request already in the batch than it
# finds in the cache waits one step, and then finds them in the cache
DEFER_MIN_SHARED = 32


class ChunkedReq(Req):
    """A prompt computed in parts: it keeps its row and handle between steps, is
    never decoded, and the token sampled after a part is thrown away."""

    def append_host(self, next_token: int | torch.Tensor) -> None:
        raise RuntimeError("a ChunkedReq has no next token: its prompt is not finished")

    @property
    def can_decode(self) -> bool:
        return False


class PrefillAdder:
    """Admits requests into one prefill batch while the budgets allow."""

    def __init__(self, token_budget: int, reserved_size: int, cache_manager: CacheManager,
                 table_manager: TableManager) -> None:
        self.token_budget = token_budget  # prompt tokens this batch may still compute
        self.reserved_size = reserved_size  # KV tokens already promised to admitted requests
        self.cache_manager, self.table_manager = cache_manager, table_manager

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if (chunked := pending.chunked_req) is not None:  # its next part: resources are held
            assert chunked.cache_handle is not None
            return self._add(pending, chunked.table_idx, chunked.cache_handle, chunked.cached_len)
        if (got := self._try_allocate(pending)) is None:
            return None
        row, handle = got
        return self._add(pending, row, handle, handle.cached_len)

    def _estimate(self, pending: PendingReq, cached_len: int) -> int:
        """KV tokens the request may need from now on: uncached prompt + all its output, plus
        up to one page of rounding (its uncached part starts on a page boundary)."""
        ps = self.cache_manager.page_size
        return pending.input_len - cached_len + pending.output_len + ps - 1

    def _fits(self, need: int) -> bool:
        return need + self.reserved_size <= self.cache_manager.available_size

    def _try_allocate(self, pending: PendingReq) -> tuple[int, BaseCacheHandle] | None:
        if self.table_manager.available_size == 0:
            return None
        handle = self.cache_manager.match_req(pending)
        need = self._estimate(pending, handle.cached_len)
        if not self._fits(need):
            return None
        # Locking moves the matched pages from evictable to protected, which shrinks
        # available_size: check again, or we could promise pages that only eviction of our own
        # prefix would have freed.
        self.cache_manager.lock(handle)
        if not self._fits(need):
            self.cache_manager.unlock(handle)
            return None
        row = self.table_manager.allocate()
        if handle.cached_len > 0:  # the cached part: token ids and KV slots into our row
            n = handle.cached_len
            self.table_manager.token_pool[row, :n] = pending.input_ids[:n].to(
                self.table_manager.token_pool.device, non_blocking=True)
            self.table_manager.page_table[row, :n] = handle.get_matched_indices()
        return row, handle

    def _add(self, pending: PendingReq, row: int, handle: BaseCacheHandle,
             cached_len: int) -> Req:
        remain = pending.input_len - cached_len
        size = min(self.token_budget, remain)
        self.token_budget -= size
        self.reserved_size += self._estimate(pending, cached_len)
        end = cached_len + size
        pool = self.table_manager.token_pool
        pool[row, cached_len:end] = pending.input_ids[cached_len:end].to(pool.device,
                                                                           non_blocking=True)
        cls = ChunkedReq if size < remain else Req
        return cls(pending.input_ids[:end], table_idx=row, cached_len=cached_len,
                   output_len=pending.output_len, uid=pending.uid,
                   sampling_params=pending.sampling_params, cache_handle=handle,
                   retractions=pending.retractions)


class PrefillManager:
    """The waiting requests, first come first served."""

    def __init__(self, cache_manager: CacheManager, table_manager: TableManager,
                 decode_manager: DecodeManager) -> None:
        self.cache_manager, self.table_manager = cache_manager, table_manager
        self.decode_manager = decode_manager
        self.pending: list[PendingReq] = []

    def add_one_req(self, req: PendingReq) -> None:
        self.pending.append(req)

    def requeue(self, reqs: list[PendingReq]) -> None:
        """Retracted requests go first, before every request that has not run yet (so none
        waits for ever behind a stream of new ones), after a prompt part-way through its
        prefill (which holds pages and a row)."""
        at = next((i for i, p in enumerate(self.pending) if p.chunked_req is None),
                  len(self.pending))
        self.pending[at:at] = reqs

    def promised_tokens(self, page_size: int) -> int:
        """KV tokens that prompts part-way through their prefill will still take: admitted, so
        promised, and not the running requests' to use. Such prompts lead the queue."""
        total = 0
        for p in self.pending:
            if p.chunked_req is None:
                break
            total += (-(-p.input_len // page_size) - -(-p.chunked_req.cached_len // page_size))
        return total * page_size

    def schedule_next_batch(self, token_budget: int) -> Batch | None:
        adder = PrefillAdder(token_budget, self.decode_manager.inflight_tokens,
                             self.cache_manager, self.table_manager)
        reqs: list[Req] = []
        heads: dict[tuple[str, bytes], list[Req]] = {}  # the batch's requests by _head
        waiting: list[PendingReq] = []  # chunked or deferred: they stay in the queue
        for i, pending in enumerate(self.pending):
            if pending.chunked_req is None and self._shares_with(pending, heads):
                waiting.append(pending)
                continue
            req = adder.try_add_one(pending)
            if req is None:  # out of budget, rows or KV: keep the order, stop here
                waiting += self.pending[i:]
                break
            pending.chunked_req = req if isinstance(req, ChunkedReq) else None
            if pending.chunked_req is not None:
                waiting.insert(0, pending)  # its next part goes first next time
            reqs.append(req)
            assert req.cache_handle is not None  # every request here got its pages
            if (head := self._head(req.cache_handle.salt, req.input_ids)) is not None:
                heads.setdefault(head, []).append(req)
        self.pending = waiting
        return Batch(reqs, "prefill") if reqs else None

    @property
    def _defer_min(self) -> int:
        return max(DEFER_MIN_SHARED, self.cache_manager.page_size)

    def _head(self, salt: str, ids: torch.Tensor) -> tuple[str, bytes] | None:
        """The salt and the first _defer_min tokens: two requests can share that many only if
        these are equal (None: too short to share that many)."""
        n = self._defer_min
        return None if len(ids) < n else (salt, ids[:n].numpy().tobytes())

    def _shares_with(self, pending: PendingReq,
                     heads: dict[tuple[str, bytes], list[Req]]) -> bool:
        """Does a request already in this batch hold a prefix of ours that the cache does not
        have yet? Requests of one batch cannot read each other's K/V, so computing that prefix
        twice would be waste: better wait one step and find it in the cache. Only
        a request with our salt counts: we would never find another salt's prefix there. Only
        the batch's requests that begin as we do are compared (a dict lookup, where comparing
        against all of them cost O(batch^2) token comparisons per prefill)."""
        if not heads or not self.cache_manager.prefix_cache.reuses_prefixes:
            return False
        ids = pending.input_ids[:-1]
        head = self._head(pending.cache_salt, ids)
        if head is None or not (same := heads.get(head)):
            return False
        cached = self.cache_manager.match_req(pending).cached_len
        shared = max(match_len(r.input_ids, ids) for r in same)
        return shared - cached >= self._defer_min

    @property
    def runnable(self) -> bool:
        return bool(self.pending)

    @property
    def chunking(self) -> bool:
        """A prompt is part-way through its prefill."""
        return bool(self.pending) and self.pending[0].chunked_req is not None

    def filling_longer_than(self, tokens: int) -> bool:
        """A prompt of more than `tokens` tokens is part-way through its prefill (the server
        gives decoding a turn between its chunks)."""
        return self.chunking and self.pending[0].input_len > tokens
