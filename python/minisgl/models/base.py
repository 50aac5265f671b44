"""BaseLLMModel: a model's forward() takes no arguments; it reads the batch (chapter 3)."""

from __future__ import annotations

from abc import abstractmethod

import torch

from minisgl.layers import BaseOP


class BaseLLMModel(BaseOP):
    @abstractmethod
    def forward(self) -> torch.Tensor:
        """Logits [batch size, vocab] for the current batch of get_global_ctx()."""
