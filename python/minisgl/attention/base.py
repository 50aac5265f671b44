"""The attention backend interface and its per-batch metadata (chapter 5)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl.core import Batch


class BaseAttnMetadata:  # noqa: B903 (each backend subclasses it with its own fields)
    """What a backend precomputes once per batch and reuses in every layer."""


class BaseAttnBackend(ABC):
    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Build batch.attn_metadata; called once per batch, after positions and out_loc."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        """Attention of q [T, Hq, D] over each request's cached tokens; the new k, v are
        already stored in the pool by AttentionLayer. Returns [T, Hq, D]."""

    # CUDA graph hooks; a backend that cannot be captured keeps these defaults.
    @property
    def supports_graphs(self) -> bool:
        return type(self).prepare_for_replay is not BaseAttnBackend.prepare_for_replay

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")
