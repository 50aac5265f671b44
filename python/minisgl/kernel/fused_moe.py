"""The Triton grouped GEMM of the fused MoE (chapter 20): one expert per row block, pairs read by
sorted id. Imported only by the triton MoE backend: the package runs without Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from minisgl.moe.triton_backend import Alignment


@triton.jit
def _expert_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
                        num_padded_ptr, N, K, num_pairs, stride_am, stride_be, stride_bn,
                        stride_cm, A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[p, n0:n0+BN] = A[p // A_ROW_DIV] @ B[e].T for the BLOCK_M pairs p of row block m,
    all of expert e = block_expert[m]; optionally times the pair's routing weight."""
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    if block_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last expert's run: the capacity is an upper bound
    expert = tl.load(block_expert_ptr + block_m).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + block_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    real = pairs < num_pairs  # padding entries hold num_pairs
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    # A's rows are the pairs' tokens (gate_up) or the pairs themselves (down); B[e] is [N, K],
    # read transposed as a [BLOCK_K, BLOCK_N] tile; K is contiguous in both
    a_ptrs = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's workaround, see expert_gemm; compiled out on a GPU
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=real, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


# TRITON_INTERPRET=1 at import time turns the kernel into a Python function that numpy runs on
# the CPU, one program at a time: slow, but the same code, checkable without a GPU
INTERPRETED = type(_expert_gemm_kernel).__name__ == "InterpretedFunction"


def expert_gemm(a: torch.Tensor, b: torch.Tensor, align: Alignment, num_pairs: int,
                a_row_div: int, weights: torch.Tensor | None,
                blocks: tuple[int, int, int]) -> torch.Tensor:
    """[num_pairs, N]: row p = a[p // a_row_div] @ b[expert of p].T, times weights[p] if given,
    accumulated in float32 and stored in a's dtype. a [*, K], b [E, N, K]."""
    bm, bn, bk = blocks
    assert a.stride(1) == 1 and b.stride(2) == 1 and a.shape[1] == b.shape[2], (a.shape, b.shape)
    n = b.shape[1]
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (align.sorted_ids.shape[0] // bm, triton.cdiv(n, bn))
    _expert_gemm_kernel[grid](
        a_ptr=a, b_ptr=b, c_ptr=c, weight_ptr=weights if weights is not None else c,
        sorted_ids_ptr=align.sorted_ids, block_expert_ptr=align.block_expert,
        num_padded_ptr=align.num_padded, N=n, K=a.shape[1], num_pairs=num_pairs,
        stride_am=a.stride(0), stride_be=b.stride(0), stride_bn=b.stride(1),
        stride_cm=c.stride(0), A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        # float32 in, float32 exactly (a GPU would otherwise round the inputs to tf32)
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton 3.9's interpreter gets tl.dot of bfloat16 tiles wrong (values near 1e10 for
        # unit inputs): there the tiles are widened to float32 first, the same products a GPU's
        # bf16 x bf16 -> fp32 dot forms. (Its float32 -> bfloat16 casts also round toward zero,
        # not to nearest: interpreted bfloat16 results are a little further off than a GPU's.)
        UPCAST=INTERPRETED and a.dtype != torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return c
