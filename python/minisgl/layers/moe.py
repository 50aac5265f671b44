"""MoELayer: one layer's experts stacked in two tensors, run by the chosen backend (chapter 20)."""

from __future__ import annotations

import torch

from minisgl.core import get_global_ctx
from minisgl.distributed import all_reduce, get_tp_info

from .base import BaseOP


class MoELayer(BaseOP):
    """gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj
    [E, H, I]. Under tensor parallelism I is this rank's share of moe_intermediate_size, as a
    dense MLP's is: each rank computes a partial sum of every expert's output, and one
    all-reduce per layer adds them up (the row-parallel rule)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        self.gate_up_proj = torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        self.down_proj = torch.empty(num_experts, hidden_size, intermediate_size)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = get_global_ctx().moe_backend.forward(
            x, self.gate_up_proj, self.down_proj, router_logits=router_logits, top_k=self.top_k,
            renormalize=self.renormalize)
        return all_reduce(out) if get_tp_info().size > 1 else out
