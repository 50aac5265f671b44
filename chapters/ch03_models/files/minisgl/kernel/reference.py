"""Reference kernels in plain PyTorch, the CPU stand-ins for FlashInfer's fused ops (chapter 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + residual, then normalised: returns (normed, x + residual). Out of place here; a GPU
    kernel (FlashInfer's) does both in one pass and updates its inputs in place."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] and k [T, Hk*D] by position (NeoX layout: dim j pairs with j + D/2).

    cos_sin_cache is [max_position, D] in float32: cos in the first half, sin in the second.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], -1)[:, None, :]
    sin = torch.cat([sin, sin], -1)[:, None, :]
    head_dim = cos_sin_cache.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_dim)
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        rotated = torch.cat([-x2, x1], -1)
        return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).flatten(1)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)

