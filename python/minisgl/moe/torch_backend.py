"""The torch MoE backend: a loop over the experts that got tokens, the reference (chapter 20)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernel import silu_and_mul

from .base import BaseMoeBackend


class TorchMoeBackend(BaseMoeBackend):
    """Sorts the (token, slot) pairs by expert, then one pair of matmuls per expert on its
    tokens, weighted and added into the output with index_add_. Reading the per-expert counts
    on the host makes it exact and simple, and unfit for a CUDA graph."""

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top_k, num_experts = ids.shape[1], gate_up.shape[0]
        flat = ids.flatten()  # pair p = t * top_k + j
        order = flat.argsort(stable=True)  # the pairs, grouped by expert
        counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host read
        flat_weights = weights.flatten()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = pairs // top_k
            h = F.linear(silu_and_mul(F.linear(x[tokens], gate_up[e])), down[e])
            out.index_add_(0, tokens, h.float() * flat_weights[pairs, None])
        return out.to(x.dtype)
