"""The linear family: merged QKV, merged gate/up, output projections (chapter 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.distributed import all_reduce, get_tp_info

from .base import BaseOP


class _Linear(BaseOP):
    def __init__(self, input_size: int, output_size: int, has_bias: bool) -> None:
        self.weight = torch.empty(output_size, input_size)
        self.bias = torch.empty(output_size) if has_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LinearReplicated(_Linear):
    """A plain linear layer (every TP rank holds all of it)."""


class LinearQKVMerged(_Linear):
    """q_proj, k_proj and v_proj stacked into one [(Hq + 2 Hkv) * D, hidden] matrix."""

    def __init__(self, hidden_size: int, head_dim: int, num_qo_heads: int, num_kv_heads: int,
                 has_bias: bool = False) -> None:
        super().__init__(hidden_size, (num_qo_heads + 2 * num_kv_heads) * head_dim, has_bias)


class LinearColParallelMerged(_Linear):
    """Several projections of the same input stacked by rows, e.g. gate_proj and up_proj."""

    def __init__(self, input_size: int, output_sizes: list[int], has_bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), has_bias)


class LinearRowParallel(_Linear):
    """The MLP's down_proj. Under tensor parallelism each rank holds the columns of its share
    of the input, so its output is a partial sum: all-reduced, and the bias added once after."""

    def __init__(self, input_size: int, output_size: int, has_bias: bool = False) -> None:
        super().__init__(input_size, output_size, has_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.linear(x, self.weight, self.bias)
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class LinearOProj(LinearRowParallel):
    """Attention's output projection o_proj: row-parallel like down_proj (its input is this
    rank's heads)."""
