"""CacheManager: the scheduler's KV pages, a free list (chapter 7; the prefix cache joins in
chapter 9)."""

from __future__ import annotations

import torch

from minisgl.core import Req
from minisgl.utils.device import pin_memory


class CacheManager:
    """Pages are handed out whole and named by their first token slot (page * page_size), so a
    slot is always `free_slots[i] + offset`. Every page is in exactly one place: the free list,
    or the page-table row of the one running request that owns it."""

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor) -> None:
        self.device = page_table.device
        self.num_pages, self.page_size, self.page_table = num_pages, page_size, page_table
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size

    @property
    def available_size(self) -> int:
        """Tokens we could place now."""
        return len(self.free_slots) * self.page_size

    def allocate_paged(self, reqs: list[Req]) -> None:
        """Give each request the pages for positions cached_len..device_len-1 that it does not
        have yet, and write their slots into its page-table row."""
        ps = self.page_size
        spans = [(r.table_idx, -(-r.cached_len // ps), -(-r.device_len // ps)) for r in reqs]
        spans = [(row, first, last) for row, first, last in spans if last > first]
        needed = sum(last - first for _, first, last in spans)
        if needed == 0:
            return
        pages = self._allocate(needed)
        slots = (pages[:, None] + torch.arange(ps, dtype=torch.int32, device=self.device)).view(-1)
        cells = table_cells([(row, first * ps, (last - first) * ps) for row, first, last in spans],
                            self.device)
        self.page_table[cells] = slots

    def free_req(self, req: Req) -> None:
        """Return every page of a finished request: its slots 0..cached_len-1 touch them all."""
        self._free(self.page_table[req.table_idx, : req.cached_len])

    def check_integrity(self) -> None:
        """With no request running, every page is free, each exactly once."""
        free = self.free_slots.tolist()
        if len(set(free)) != self.num_pages or len(free) != self.num_pages:
            raise RuntimeError(f"KV pages lost or doubled: {len(free)} free "
                               f"({len(set(free))} distinct) != {self.num_pages}")

    def _allocate(self, num_pages: int) -> torch.Tensor:
        if num_pages > len(self.free_slots):
            raise RuntimeError(f"out of KV pages: {num_pages} needed, {len(self.free_slots)} "
                               "free (chapter 8's admission control makes requests wait instead)")
        pages, self.free_slots = self.free_slots[:num_pages], self.free_slots[num_pages:]
        return pages

    def _free(self, slots: torch.Tensor) -> None:
        """Return the pages of a page-aligned run of slots."""
        if len(slots):
            self.free_slots = torch.cat([self.free_slots, slots[:: self.page_size]])


def table_cells(spans: list[tuple[int, int, int]],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The page-table cells covered by spans of (row, first column, length), as int64 row and
    column tensors on the device. A few tensor ops, however many cells: a Python loop over
    cells or spans would cost a few microseconds each, at every step."""
    host = torch.tensor(spans, dtype=torch.int64).view(-1, 3)
    rows, firsts, lengths = host.unbind(1)
    total = sum(length for _, _, length in spans)
    starts = torch.cumsum(lengths, 0) - lengths  # where each span begins in the output
    cols = torch.arange(total) + (firsts - starts).repeat_interleave(lengths, output_size=total)
    cells = torch.empty(2, total, dtype=torch.int64, pin_memory=pin_memory(device))
    torch.stack([rows.repeat_interleave(lengths, output_size=total), cols], out=cells)
    cells = cells.to(device, non_blocking=True)
    return cells[0], cells[1]
