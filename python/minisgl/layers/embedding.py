"""Token embedding and the LM head, which may share the embedding's table (chapter 2)."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from minisgl.core import get_global_ctx
from minisgl.distributed import all_gather, all_reduce, get_tp_info
from minisgl.distributed.shard import vocab_rows
from minisgl.kernel import embedding
from minisgl.utils.device import to_device

from .base import BaseOP


class VocabParallelEmbedding(BaseOP):
    """Under tensor parallelism each rank holds rows [start, stop) of the table (padded to an
    equal share): ids elsewhere give zero rows, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_size, self._rows = vocab_size, vocab_rows(vocab_size, get_tp_info())
        self.weight = torch.empty(self._rows.size, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return embedding(ids, self.weight)
        return all_reduce(embedding(ids, self.weight, self._rows.start))


class ParallelLMHead(BaseOP):
    """hidden -> vocab logits, for the last token of each request only. With tied embeddings
    it keeps no weight of its own (the checkpoint has no lm_head.weight) and reads the
    embedding's table."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied: VocabParallelEmbedding | None = None) -> None:
        self._tied, self.vocab_size = tied, vocab_size
        if tied is None:
            self.weight = torch.empty(vocab_rows(vocab_size, get_tp_info()).size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = get_global_ctx().batch
        if batch.is_prefill:  # only each request's last position predicts a token
            ends = list(accumulate(r.extend_len for r in batch.reqs))
            x = x[to_device([e - 1 for e in ends], torch.int64, x.device)]
        weight = self._tied.weight if self._tied is not None else self.weight
        logits = F.linear(x, weight)
        if get_tp_info().size == 1:
            return logits
        # every rank's share of the vocabulary, side by side, the padding cut off
        gathered = all_gather(logits)  # [tp, N, share]
        return gathered.permute(1, 0, 2).reshape(len(x), -1)[:, : self.vocab_size]
