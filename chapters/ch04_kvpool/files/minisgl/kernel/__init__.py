"""Kernels: plain-PyTorch reference versions that run anywhere (chapter 2; store_cache: 4)."""

from .reference import (
    apply_rope,
    apply_rope_with,
    embedding,
    fused_add_rms_norm,
    rms_norm,
    rope_cos_sin,
    silu_and_mul,
    store_cache,
)

__all__ = [
    "apply_rope",
    "apply_rope_with",
    "embedding",
    "fused_add_rms_norm",
    "rms_norm",
    "rope_cos_sin",
    "silu_and_mul",
    "store_cache",
]
