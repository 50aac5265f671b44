"""Kernels (chapter 2): plain-PyTorch references that run anywhere, and our own CUDA kernels in
their place where they apply.

MINISGL_KERNELS chooses: `auto` (the default) runs ours on CUDA tensors when nvcc can build
them, `torch` always runs the references, `cuda` runs ours everywhere, on the CPU emulator
for CPU tensors (slow; for checking)."""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache

import torch

from . import cuda, reference
from .reference import apply_rope, apply_rope_with, rope_cos_sin

logger = logging.getLogger(__name__)
MODES = ("auto", "torch", "cuda")


@cache
def mode() -> str:
    chosen = os.environ.get("MINISGL_KERNELS", "auto")
    if chosen not in MODES:
        raise ValueError(f"MINISGL_KERNELS={chosen!r}: choose one of {', '.join(MODES)}")
    return chosen


@cache
def _nvcc_found() -> bool:
    if shutil.which("nvcc") is None:
        logger.warning("nvcc not found: using the torch reference kernels instead of ours "
                       "(install the CUDA toolkit to build them)")
        return False
    return True


def ours(x: torch.Tensor) -> bool:
    """Whether our CUDA kernels (or their emulation) compute on x."""
    if x.dtype not in cuda.DTYPES or mode() == "torch":
        return False
    return mode() == "cuda" or (x.is_cuda and _nvcc_found())


def describe(device: torch.device) -> str:
    """Which kernels compute on `device`, for the engine's log line."""
    if mode() == "torch":
        return "torch's ops (MINISGL_KERNELS=torch)"
    if device.type == "cuda":
        return "ours, built by nvcc" if mode() == "cuda" or _nvcc_found() else \
            "torch's ops (nvcc not found)"
    if mode() == "cuda":
        return "ours, on the CPU emulator (MINISGL_KERNELS=cuda)"
    return "torch's ops (ours are CUDA kernels; MINISGL_KERNELS=cuda emulates them here)"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (cuda if ours(x) else reference).rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual). Ours writes them into x and residual; the reference
    returns new tensors: a caller uses what is returned, and neither input again."""
    return (cuda if ours(x) else reference).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return (cuda if ours(x) else reference).silu_and_mul(x)


def embedding(ids: torch.Tensor, weight: torch.Tensor, start: int | None = None) -> torch.Tensor:
    """weight[ids]; or, for a rank holding the rows [start, start + len(weight)) of the
    vocabulary (tensor parallelism), weight[ids - start] for its ids and zero rows for the others.
    The whole table is torch's single gather: on the H200 ours was no faster."""
    if start is None:
        return reference.embedding(ids, weight)
    if ours(weight):
        return cuda.embedding(ids.to(torch.int32), weight, start)
    local = ids - start
    mine = (local >= 0) & (local < len(weight))
    rows = reference.embedding(torch.where(mine, local, 0), weight)
    return rows * mine.unsqueeze(-1).to(rows.dtype)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our rotary kernel, for when ours(q): it looks each token's row of the table up itself."""
    return cuda.rope(positions, q, k, table=cos_sin_cache, head_dim=cos_sin_cache.shape[-1])


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our kernel for Qwen3's q/k norms and the rotation in one launch, for when ours(q)."""
    return cuda.qk_norm_rope(positions, q, k, q_weight=q_weight, k_weight=k_weight, eps=eps,
                             table=cos_sin_cache)


def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    (cuda if ours(k) else reference).store_cache(k_cache, v_cache, indices=indices, k=k, v=v)


__all__ = [
    "apply_rope",
    "apply_rope_with",
    "describe",
    "embedding",
    "fused_add_rms_norm",
    "ours",
    "qk_norm_rope",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "silu_and_mul",
    "store_cache",
]
