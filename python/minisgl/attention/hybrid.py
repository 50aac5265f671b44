"""HybridBackend (`--attn PREFILL,DECODE`, chapter 17): one backend for prefill batches, another
for decode."""

from __future__ import annotations

import torch

from minisgl.core import Batch

from .base import BaseAttnBackend


class HybridBackend(BaseAttnBackend):
    """Each batch goes whole to one of the two, by its phase. Graphs capture decode batches
    only, so the graph hooks are the decode backend's."""

    def __init__(self, prefill: BaseAttnBackend, decode: BaseAttnBackend) -> None:
        self.prefill, self.decode = prefill, decode

    def _for(self, batch: Batch) -> BaseAttnBackend:
        return self.prefill if batch.is_prefill else self.decode

    def prepare_metadata(self, batch: Batch) -> None:
        self._for(batch).prepare_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        return self._for(batch).forward(q, k, v, layer_id=layer_id, batch=batch)

    @property
    def supports_graphs(self) -> bool:
        return self.decode.supports_graphs

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        self.decode.init_capture_graph(max_seq_len, bs_list)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode.prepare_for_replay(batch)
