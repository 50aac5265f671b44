"""Chapter 19's CUDA kernels, compiled by nvcc for this GPU, against the torch ops they replace
on the Qwen3-0.6B shapes (tools/gpu_common.py's kernel_cases): float32 equal to rounding,
bfloat16 within two roundings, the KV store bit-equal. Their times are
`benchmark/gpu_bench.py kernels`."""

from __future__ import annotations

import pytest
import torch
from gpu_common import kernel_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]

# bfloat16: both round twice (normed, then times the weight); sums in another order can flip a
# rounding, so ours and torch's may be two units in the last place apart
TOLERANCES = [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """Our kernels built (nvcc, once per source: cached) and loaded."""
    from minisgl.kernel import cuda

    cuda.load(False)


@pytest.mark.parametrize("t", [1, 77, 4096])
@pytest.mark.parametrize("dtype,tol", TOLERANCES, ids=["float32", "bfloat16"])
def test_kernels_equal_torch_ops(dtype: torch.dtype, tol: float, t: int) -> None:
    """Every kernel but the KV store (it writes the caches: below) at T tokens, each of its
    outputs allclose to torch's with rtol = atol = tol; the message counts bit-equal elements."""
    failed = []
    for name, (ours, ref, _) in kernel_cases(dtype, t).items():
        if name.startswith("store_kv"):
            continue
        got, want = ours(), ref()
        pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
        bad = [float((a.float() - b.float()).abs().max()) for a, b in pairs
               if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)]
        if bad:
            same = sum(int((a == b).sum()) for a, b in pairs) / sum(a.numel() for a, _ in pairs)
            failed.append(f"{name}: max |d| {max(bad):.2e} (tolerance {tol:g}); "
                          f"{100 * same:.2f}% of elements bit-equal to torch's")
    assert not failed, f"T={t}:\n" + "\n".join(failed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_store_kv_bit_equal_to_index_put(dtype: torch.dtype) -> None:
    """333 tokens into caches of 16384 slots, int64 slot indices this time."""
    from minisgl.kernel import cuda, reference

    kc, vc = (torch.randn(16384, 8, 128, device="cuda").to(dtype) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    loc = torch.randperm(16384, device="cuda")[:333]
    k, v = (torch.randn(333, 8, 128, device="cuda").to(dtype) for _ in range(2))
    cuda.store_cache(kc, vc, loc, k, v)
    reference.store_cache(kc2, vc2, loc, k, v)
    for which, ours, want in (("k", kc, kc2), ("v", vc, vc2)):
        assert torch.equal(ours, want), (f"{which} cache: {int((ours != want).sum())} elements "
                                         "differ from torch's index_put")
