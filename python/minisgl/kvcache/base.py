"""The KV cache pool interface (chapter 4) and the prefix cache interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class BaseKVCachePool(ABC):
    """Per-layer K and V storage addressed by flat token slots (page * page_size + offset)."""

    @abstractmethod
    def k_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def v_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        """Write k[i], v[i] ([T, kv_heads, head_dim]) into slot out_loc[i] of `layer_id`."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class BaseCacheHandle(ABC):
    """What a prefix match found: its first `cached_len` tokens already have K/V in the cache.
    While a request holds its handle locked, those pages cannot be evicted.
    `salt` is the cache salt of the match: the request's K/V are inserted under it later, and
    only requests with the same salt share cached prefixes (the default "" is one tenant)."""

    cached_len: int
    salt: str = field(default="", kw_only=True)

    @abstractmethod
    def get_matched_indices(self) -> torch.Tensor:
        """The token slots of the matched prefix, [cached_len] int32 on the device."""


class SizeInfo(NamedTuple):
    evictable_size: int  # tokens in the cache no running request uses: eviction may take them
    protected_size: int  # tokens some running request holds locked

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class InsertResult(NamedTuple):
    cached_len: int  # how much of the inserted prefix the cache already held (our copy is spare)
    handle: BaseCacheHandle  # the whole inserted (page-aligned) prefix


class BasePrefixCache(ABC):
    """Maps token prefixes to the KV slots that hold them."""

    reuses_prefixes = True  # False for a cache that never matches anything

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor, salt: str = "") -> BaseCacheHandle:
        """The longest cached page-aligned prefix of input_ids among those inserted with the
        same salt; the handle carries the salt. Adds and removes nothing (it may
        split a node and marks what it touched as recently used); the slots are safe to use only
        once the handle is locked."""

    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Protect (or release) the handle's prefix from eviction: a reference count."""

    @abstractmethod
    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor,
                      salt: str = "") -> InsertResult:
        """Record that slots `indices` hold the K/V of `input_ids` (only whole pages are kept),
        for matches with the same salt only."""

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Drop at least `size` unreferenced tokens, least recently used first; their slots."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise if the bookkeeping is inconsistent."""
