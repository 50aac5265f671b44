"""PrefillManager and PrefillAdder: which waiting requests join the next prefill batch
(chapter 7; admission control in chapter 8)."""

from __future__ import annotations

from minisgl.core import Batch, Req

from .cache import CacheManager
from .decode import DecodeManager
from .table import TableManager
from .utils import PendingReq


class PrefillAdder:
    """Admits requests into one prefill batch while the budgets allow (chapter 8)."""

    def __init__(self, reserved_size: int, cache_manager: CacheManager,
                 table_manager: TableManager) -> None:
        self.reserved_size = reserved_size  # KV tokens already promised to admitted requests
        self.cache_manager, self.table_manager = cache_manager, table_manager

    def try_add_one(self, pending: PendingReq) -> Req | None:
        if self.table_manager.available_size == 0:
            return None
        need = self._estimate(pending)
        if need + self.reserved_size > self.cache_manager.available_size:
            return None
        row = self.table_manager.allocate()
        self.reserved_size += need
        pool = self.table_manager.token_pool
        pool[row, : pending.input_len] = pending.input_ids.to(pool.device, non_blocking=True)
        return Req(pending.input_ids, row, 0, pending.output_len, pending.uid,
                   pending.sampling_params)

    def _estimate(self, pending: PendingReq) -> int:
        """KV tokens the request may need from now on: prompt + all its output, plus up to one
        page of rounding (pages are allocated whole)."""
        return pending.input_len + pending.output_len + self.cache_manager.page_size - 1


class PrefillManager:
    """The waiting requests, first come first served."""

    def __init__(self, cache_manager: CacheManager, table_manager: TableManager,
                 decode_manager: DecodeManager) -> None:
        self.cache_manager, self.table_manager = cache_manager, table_manager
        self.decode_manager = decode_manager
        self.pending: list[PendingReq] = []

    def add_one_req(self, req: PendingReq) -> None:
        self.pending.append(req)

    def schedule_next_batch(self) -> Batch | None:
        adder = PrefillAdder(self.decode_manager.inflight_tokens, self.cache_manager,
                             self.table_manager)
        reqs: list[Req] = []
        for pending in self.pending:
            req = adder.try_add_one(pending)
            if req is None:  # out of rows or KV: keep the order, the rest wait
                break
            reqs.append(req)
        self.pending = self.pending[len(reqs) :]
        return Batch(reqs, "prefill") if reqs else None

    @property
    def runnable(self) -> bool:
        return bool(self.pending)
