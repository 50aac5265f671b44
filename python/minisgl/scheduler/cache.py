"""CacheManager: the scheduler's KV pages, a free list plus the prefix cache (chapter 7)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl.core import Req
from minisgl.kvcache import BaseCacheHandle, create_prefix_cache
from minisgl.utils.device import pin_memory

if TYPE_CHECKING:
    from .utils import PendingReq


class CacheManager:
    """Pages are handed out whole and named by their first token slot (page * page_size), so a
    slot is always `free_slots[i] + offset`. Every page is in exactly one place: the free list,
    the prefix cache, or the page-table row of the one running request that owns it."""

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor,
                 cache_type: str = "radix") -> None:
        self.device = page_table.device
        self.num_pages, self.page_size, self.page_table = num_pages, page_size, page_table
        self.free_slots = torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        self.prefix_cache = create_prefix_cache(cache_type, page_size, self.device)

    @property
    def available_size(self) -> int:
        """Tokens we could place now: free pages, plus what eviction could free."""
        return len(self.free_slots) * self.page_size + self.prefix_cache.size_info.evictable_size

    def match_req(self, req: PendingReq) -> BaseCacheHandle:
        """The cached prefix of a prompt, leaving at least its last token to compute: a prefill
        must run on at least one token to produce the logits of the first output token. Only
        prefixes cached under the request's salt count; the handle carries the salt."""
        return self.prefix_cache.match_prefix(req.input_ids[: req.input_len - 1], req.cache_salt)

    def lock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle)

    def unlock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    def allocate_paged(self, reqs: list[Req]) -> None:
        """Give each request the pages for positions cached_len..device_len-1 that it does not
        have yet, and write their slots into its page-table row."""
        ps = self.page_size
        spans = [(row, first, last) for row, first, last in self._new_pages(reqs) if last > first]
        needed = sum(last - first for _, first, last in spans)
        if needed == 0:
            return
        pages = self._allocate(needed)
        slots = (pages[:, None] + torch.arange(ps, dtype=torch.int32, device=self.device)).view(-1)
        cells = table_cells([(row, first * ps, (last - first) * ps) for row, first, last in spans],
                            self.device)
        self.page_table[cells] = slots

    def pages_needed(self, reqs: list[Req]) -> int:
        """The pages allocate_paged would take for these requests now."""
        return sum(last - first for _, first, last in self._new_pages(reqs))

    def _new_pages(self, reqs: list[Req]) -> list[tuple[int, int, int]]:
        """(row, first page, end page) of the pages each request lacks for positions
        cached_len..device_len-1 (none when first == end)."""
        ps = self.page_size
        return [(r.table_idx, -(-r.cached_len // ps), -(-r.device_len // ps)) for r in reqs]

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Hand the request's computed K/V (positions 0..cached_len-1) to the prefix cache.

        - [0, old.cached_len): matched at admission, already the cache's pages;
        - [old.cached_len, in_cache): computed by us, but meanwhile another request inserted the
          same tokens: the cache keeps its pages, ours are spare and freed, and our row is
          pointed at the cache's pages (identical K/V) so we never read a freed page;
        - [in_cache, new.cached_len): inserted now, the cache owns them from here on;
        - [new.cached_len, cached_len): the last partial page, which the cache does not take:
          still ours while we run, freed when we finish."""
        slots = self.page_table[req.table_idx, : req.cached_len]
        old = req.cache_handle  # its salt is the request's: the insertion goes under it
        assert old is not None, "a running request holds its cache handle"
        in_cache, new = self.prefix_cache.insert_prefix(req.input_ids[: req.cached_len], slots,
                                                        old.salt)
        self.unlock(old)
        if in_cache > old.cached_len:
            spare = slots[old.cached_len : in_cache].clone()
            slots[old.cached_len : in_cache] = new.get_matched_indices()[old.cached_len : in_cache]
            self._free(spare)
        if finished:
            self._free(slots[new.cached_len :])
        else:
            req.cache_handle = new
            self.lock(new)

    def check_integrity(self) -> None:
        """With no request running, every page is free or in the cache, each exactly once."""
        self.prefix_cache.check_integrity()
        cached = self.prefix_cache.size_info.total_size // self.page_size
        free = self.free_slots.tolist()
        if len(free) + cached != self.num_pages or len(set(free)) != len(free):
            raise RuntimeError(f"KV pages lost or doubled: {len(free)} free ({len(set(free))} "
                               f"distinct) + {cached} cached != {self.num_pages}")
        if any(s % self.page_size for s in free):
            raise RuntimeError("a free slot is not the first slot of a page")

    def _allocate(self, num_pages: int) -> torch.Tensor:
        if num_pages > len(self.free_slots):
            evicted = self.prefix_cache.evict((num_pages - len(self.free_slots)) * self.page_size)
            self.free_slots = torch.cat([self.free_slots, evicted[:: self.page_size]])
        if num_pages > len(self.free_slots):
            raise RuntimeError(f"out of KV pages: {num_pages} needed, {len(self.free_slots)} "
                               "free; admission control should have prevented this")
        pages, self.free_slots = self.free_slots[:num_pages], self.free_slots[num_pages:]
        return pages

    def _free(self, slots: torch.Tensor) -> None:
        """Return the pages of a page-aligned run of slots."""
        if len(slots):
            self.free_slots = torch.cat([self.free_slots, slots[:: self.page_size]])


def table_cells(spans: list[tuple[int, int, int]],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The page-table cells covered by spans of (row, first column, length), as int64 row and
    column tensors on the device. A few numpy operations, however many cells, and one copy.
    Not torch's CPU operations: some of them (repeat_interleave) fan out to the intra-op thread
    pool for any size, and on a server whose other processes keep the cores busy each such
    call waits at a barrier for threads that are not running."""
    table = np.array(spans, dtype=np.int64).reshape(-1, 3)
    rows, firsts, lengths = table[:, 0], table[:, 1], table[:, 2]
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths  # where each span begins in the output
    cells = torch.empty(2, total, dtype=torch.int64, pin_memory=pin_memory(device))
    host = cells.numpy()
    host[0] = np.repeat(rows, lengths)
    host[1] = np.arange(total) + np.repeat(firsts - starts, lengths)
    cells = cells.to(device, non_blocking=True)
    return cells[0], cells[1]
