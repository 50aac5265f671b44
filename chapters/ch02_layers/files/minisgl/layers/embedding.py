"""Token embedding and the LM head, which may share the embedding's table (chapter 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.core import get_global_ctx
from minisgl.kernel import embedding

from .base import BaseOP


class VocabParallelEmbedding(BaseOP):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.weight = torch.empty(vocab_size, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight)


class ParallelLMHead(BaseOP):
    """hidden -> vocab logits, for the last token of each request only. With tied embeddings
    it keeps no weight of its own (the checkpoint has no lm_head.weight) and reads the
    embedding's table."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied: VocabParallelEmbedding | None = None) -> None:
        self._tied = tied
        if tied is None:
            self.weight = torch.empty(vocab_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = get_global_ctx().batch
        if batch.is_prefill:  # only each request's last position predicts a token
            ends = torch.tensor([r.extend_len for r in batch.reqs]).cumsum(0) - 1
            x = x[ends.to(x.device)]
        weight = self._tied.weight if self._tied is not None else self.weight
        return F.linear(x, weight)
