"""Reference kernels in plain PyTorch, the CPU stand-ins for FlashInfer's fused ops (chapter 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, normalised in float32 and rounded
    to x's dtype before the weight, as HF does. torch's rms_norm is one fused op (one kernel on
    a GPU) where pow, mean, add, rsqrt and mul would be five."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + residual, then normalised: returns (normed, x + residual). Out of place here; a GPU
    kernel (FlashInfer's) does both in one pass and updates its inputs in place."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's rows for these positions as [T, 1, D] factors in dtype: cos repeated over
    both halves, and sin with the first half negated (see apply_rope_with).

    cos_sin_cache is [max_position, D] in float32: cos in the first half, sin in the second.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], -1)[:, None, :].to(dtype)
    sin = torch.cat([-sin, sin], -1)[:, None, :].to(dtype)
    return cos, sin


def apply_rope_with(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] and k [T, Hk*D] (NeoX layout: dim j pairs with j + D/2) with factors
    from rope_cos_sin: x*cos + roll(x, D/2)*sin, where roll swaps the halves and sin's sign
    makes the first half -x2*sin, the same products HF's rotate_half forms."""
    head_dim = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_dim)
        return (x * cos + x.roll(head_dim // 2, -1) * sin).flatten(1)

    return rotate(q), rotate(k)


def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] and k [T, Hk*D] by position, looking the factors up in the table."""
    return apply_rope_with(q, k, *rope_cos_sin(positions, cos_sin_cache, q.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    """Write row i of k and v into slot indices[i] of the flat [slots, H, D] caches."""
    k_cache[indices] = k.view(-1, *k_cache.shape[1:])
    v_cache[indices] = v.view(-1, *v_cache.shape[1:])
