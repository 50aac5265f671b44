"""TableManager: rows of the page table and the token pool, one per running request (chapter 7)."""

from __future__ import annotations

import torch


class TableManager:
    def __init__(self, max_running_req: int, page_table: torch.Tensor) -> None:
        self.page_table = page_table  # [rows, max_seq_len]: KV slot of each position
        # [rows, max_seq_len]: token id at each position, on the device, so a batch's input ids
        # are one gather and a sampled token is one scatter, with no trip through the host.
        # Zeros, not garbage: a padding (dummy) request reads its row too.
        self.token_pool = torch.zeros_like(page_table)
        self.max_running_req = max_running_req
        self._free_rows = list(range(max_running_req))  # the last row is the dummy request's

    @property
    def available_size(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free table row: check available_size before allocating")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_running_req or row in self._free_rows:
            raise RuntimeError(f"table row {row} is freed twice or was never allocated")
        self._free_rows.append(row)
