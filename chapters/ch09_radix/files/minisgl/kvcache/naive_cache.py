"""NaivePrefixCache: the same interface, caching nothing: every prompt is computed (chapter 9)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BaseCacheHandle, BasePrefixCache, InsertResult, SizeInfo


@dataclass(frozen=True)
class NaiveCacheHandle(BaseCacheHandle):
    empty: torch.Tensor

    def get_matched_indices(self) -> torch.Tensor:
        return self.empty


class NaivePrefixCache(BasePrefixCache):
    reuses_prefixes = False

    def __init__(self, page_size: int, device: torch.device) -> None:
        self.handle = NaiveCacheHandle(0, torch.empty(0, dtype=torch.int32, device=device))

    def match_prefix(self, input_ids: torch.Tensor) -> BaseCacheHandle:
        return self.handle

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        pass

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        return InsertResult(0, self.handle)  # nothing kept: the caller frees every slot

    def evict(self, size: int) -> torch.Tensor:
        if size > 0:
            raise RuntimeError(f"naive cache: cannot evict {size} tokens, it holds none")
        return self.handle.empty

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def check_integrity(self) -> None:
        pass
