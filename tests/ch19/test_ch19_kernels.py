"""Chapter 19: our CUDA kernels, compiled by nvcc, and run on the CPU emulator against plain-torch
references written here (not our reference module)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from minisgl.kernel import cuda

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_nvcc_compiles_the_same_source(tmp_path) -> None:
    cmd = ["nvcc", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90",
           str(cuda.CSRC / "kernels.cu"), "-o", str(tmp_path / "k.so")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_on_the_emulator(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    slots, heads, dim, n = 64, 2, 24, 37  # 37 tokens: not a multiple of the 4 warps a block has
    k_cache = torch.randn(slots, heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, heads, dim, generator=g).to(dtype)
    k = torch.randn(n, heads, dim, generator=g).to(dtype)
    v = torch.randn(n, heads, dim, generator=g).to(dtype)
    indices = torch.randperm(slots, generator=g)[:n].to(index_dtype)
    indices[:2] = torch.tensor([0, slots - 1])  # the first and last slot
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, s in enumerate(indices.tolist()):
        want_k[s], want_v[s] = k[i], v[i]
    cuda.store_cache(k_cache, v_cache, indices, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,rows", [(0, 50), (50, 50), (37, 13)])
def test_embedding_of_a_vocabulary_range_on_the_emulator(dtype: torch.dtype, start: int,
                                                          rows: int) -> None:
    g = torch.Generator().manual_seed(1)
    vocab, hidden = 100, 40
    full = torch.randn(vocab, hidden, generator=g).to(dtype)
    # the range's edges and their neighbours, then random ids
    ids = torch.tensor([start - 1, start, start + rows - 1, start + rows, 0, vocab - 1]
                       + torch.randint(0, vocab, (20,), generator=g).tolist())
    ids = ids.clamp(0, vocab - 1).to(torch.int32)
    want = torch.stack([full[i] if start <= i < start + rows else torch.zeros(hidden, dtype=dtype)
                        for i in ids.tolist()])
    got = cuda.embedding(ids, full[start:start + rows].contiguous(), start)
    assert torch.equal(got, want)
