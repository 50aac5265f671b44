"""PrefillManager: which waiting requests join the next prefill batch (chapter 7)."""

from __future__ import annotations

from minisgl.core import Batch, Req

from .table import TableManager
from .utils import PendingReq


class PrefillManager:
    """The waiting requests, first come first served. For now a request is admitted whenever
    a table row is free; whether its K/V will fit is chapter 8's question."""

    def __init__(self, table_manager: TableManager) -> None:
        self.table_manager = table_manager
        self.pending: list[PendingReq] = []

    def add_one_req(self, req: PendingReq) -> None:
        self.pending.append(req)

    def schedule_next_batch(self) -> Batch | None:
        reqs: list[Req] = []
        pool = self.table_manager.token_pool
        while self.pending and self.table_manager.available_size > 0:
            pending = self.pending.pop(0)
            row = self.table_manager.allocate()
            pool[row, : pending.input_len] = pending.input_ids.to(pool.device, non_blocking=True)
            reqs.append(Req(pending.input_ids, row, 0, pending.output_len, pending.uid,
                            pending.sampling_params))
        return Batch(reqs, "prefill") if reqs else None

    @property
    def runnable(self) -> bool:
        return bool(self.pending)
