"""Kernels: plain-PyTorch reference versions that run anywhere (chapter 2)."""

from .reference import (
    apply_rope,
    embedding,
    fused_add_rms_norm,
    rms_norm,
    silu_and_mul,
)

__all__ = [
    "apply_rope",
    "embedding",
    "fused_add_rms_norm",
    "rms_norm",
    "silu_and_mul",
]
