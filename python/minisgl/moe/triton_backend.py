"""The triton MoE backend: pairs sorted by expert into blocks, two grouped GEMMs (chapter 20)."""

from __future__ import annotations

import importlib.util
import logging
from typing import NamedTuple

import torch

from minisgl.kernel import silu_and_mul

from .base import BaseMoeBackend

logger = logging.getLogger(__name__)


class Alignment(NamedTuple):
    """The (token, slot) pairs p = t * top_k + j laid out for a blocked GEMM: each expert's pairs
    in a run padded to a multiple of the block size, so every block belongs to one expert."""

    sorted_ids: torch.Tensor  # [capacity] int32: pair ids; padding holds num_pairs
    block_expert: torch.Tensor  # [capacity / block] int32: each block's expert, -1 past the end
    num_padded: torch.Tensor  # [1] int32: how many entries of sorted_ids are in use


def align_block_size(ids: torch.Tensor, block: int, num_experts: int) -> Alignment:
    """Sort the pairs of ids [T, top_k] by expert (by pair id within one) and pad each expert's
    run to a multiple of `block`. Sizes depend only on the shapes and values never leave the
    device, so a CUDA graph can capture it: at most min(E, pairs) experts get pairs, and each
    pads at most block - 1 entries, which bounds the capacity."""
    flat = ids.flatten().long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    end = padded.cumsum(0)  # expert e's run is [end[e] - padded[e], end[e])
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    capacity = -(-(n + min(num_experts, n) * (block - 1)) // block) * block
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[end[expert] - padded[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block, device=flat.device)
    block_expert = torch.searchsorted(end, starts, right=True)  # the run each block starts in
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_ids, block_expert, end[-1:].to(torch.int32))


def block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row blocks when experts get few pairs each (decode),
    where most of a 64-row block would be padding."""
    return (16, 64, 64) if num_pairs <= 4 * num_experts else (64, 64, 32)


class TritonMoeBackend(BaseMoeBackend):
    supports_graphs = True

    def __init__(self, device: torch.device) -> None:
        if importlib.util.find_spec("triton") is None:
            raise ImportError("the triton MoE backend needs Triton: pip install triton, or choose "
                              "--moe-backend torch")
        from minisgl.kernel import fused_moe

        if device.type != "cuda" and not fused_moe.INTERPRETED:
            raise RuntimeError("Triton compiles for a GPU; on the CPU set TRITON_INTERPRET=1 "
                               "before starting to run its interpreter (slow), or choose "
                               "--moe-backend torch")
        if device.type == "cuda" and fused_moe.INTERPRETED:
            logger.warning("TRITON_INTERPRET=1: the MoE kernels run in Triton's interpreter")
        self._kernels = fused_moe

    def experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = ids.shape
        num_experts, num_pairs = gate_up.shape[0], ids.numel()
        bm, bn, bk = block_sizes(num_pairs, num_experts)
        align = align_block_size(ids, bm, num_experts)
        run = self._kernels.expert_gemm
        # gate_up: each pair reads its token's row of x; one output row per pair
        h = run(x, gate_up, align, num_pairs=num_pairs, a_row_div=top_k, weights=None,
                blocks=(bm, bn, bk))
        h = silu_and_mul(h)
        # down: row p of h is pair p's; the routing weight is applied before the sum
        y = run(h, down, align, num_pairs=num_pairs, a_row_div=1,
                weights=weights.flatten().float(), blocks=(bm, bn, bk))
        return y.view(num_tokens, top_k, -1).sum(dim=1)

