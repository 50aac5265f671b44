"""Chapter 21: the kernels the profile sent back to work, on the CPU emulator. 16-byte loads where
rows and pointers allow and the old one-element path where they do not, a warp per short row,
Qwen3's q/k norms fused with the rotation, and the draw of a token from logits in one pass
(its frequencies against the float64 softmax).
The H200 side is tests/gpu/test_gpu_{kernels,sampler}.py; times, benchmark/gpu_bench.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import kernel
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine import sample
from minisgl.engine.sample import Sampler
from minisgl.kernel import cuda


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))


def _rms_norm64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = 1e-5 if got.dtype == torch.float32 else 2 ** -7
    return torch.allclose(got.double(), want, rtol=tol, atol=tol)


def _unaligned(x: torch.Tensor) -> torch.Tensor:
    """The same values one element past a 16-byte boundary: the kernels must take the narrow
    path."""
    room = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
    room.copy_(x)
    assert room.data_ptr() % 16 != 0
    return room


def _library_with(tmp_path: Path, find: str, replace: str) -> Any:
    csrc = tmp_path / "csrc"
    shutil.copytree(cuda.CSRC, csrc)
    source = (csrc / "kernels.cu").read_text()
    assert source.count(find) == 1
    (csrc / "kernels.cu").write_text(source.replace(find, replace))
    return cuda.open_library(cuda.build(True, csrc))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("cols", [128, 1024])  # a warp per row; a block per row
def test_rms_norm_wide_and_narrow(dtype: torch.dtype, cols: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(11, cols, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(cols, generator=g).to(dtype)
    for xx in (x, _unaligned(x)):
        assert _close(cuda.rms_norm(xx, w, 1e-6), _rms_norm64(x, w))
    want_total = (x.double() + r.double()).to(dtype)  # the sum, rounded once
    for xx in (x.clone(), _unaligned(x)):
        rr = r.clone()
        normed, total = cuda.fused_add_rms_norm(xx, rr, w, 1e-6)
        # in place, as FlashInfer's: the norm in x's memory, the sum in the residual's
        assert normed.data_ptr() == xx.data_ptr() and total.data_ptr() == rr.data_ptr()
        assert torch.equal(total, want_total)
        assert _close(normed, _rms_norm64(total, w))


def test_the_wide_path_is_the_one_taken_when_aligned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug planted in the packed store only (element 1 of every pack gets element 0's value):
    aligned rows go wrong, the same rows one element off still come out right."""
    planted = "    if (N > 1) y.v[1] = y.v[0];\n    o[p] = y;\n"
    lib = _library_with(tmp_path, "    o[p] = y;\n", planted)
    monkeypatch.setattr(cuda, "load", lambda emulate: lib)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 256, generator=g), torch.randn(256, generator=g)
    assert not _close(cuda.rms_norm(x, w, 1e-6), _rms_norm64(x, w))
    assert _close(cuda.rms_norm(_unaligned(x), w, 1e-6), _rms_norm64(x, w))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (not a GPU)")
def test_the_gpu_build_rounds_with_the_conversion_instruction(tmp_path: Path) -> None:
    """From sm_80 on, the bfloat16 kernels round with one cvt.rn.bf16.f32 (the emulator's bit
    arithmetic is some ten instructions and a branch); sm_75 has no such instruction. Checked in
    the PTX that nvcc writes, so without a GPU."""
    def ptx(arch: str) -> str:
        out = tmp_path / f"{arch}.ptx"
        cmd = cuda.build_command(False, cuda.CSRC / "kernels.cu", out, arch=arch)
        subprocess.run([a for a in cmd if a not in ("-shared", "-Xcompiler", "-fPIC")] + ["-ptx"],
                       check=True)
        return out.read_text()

    assert ptx("sm_90").count("cvt.rn.bf16.f32") > 100
    assert "cvt.rn.bf16.f32" not in ptx("sm_75")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_q_norm_a_warp_per_head_of_128(dtype: torch.dtype) -> None:
    """Qwen3's shape: heads of 128 inside the merged qkv, 7 tokens x 3 heads = 21 rows, not a
    multiple of the block's 4 warps."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(7, (3 + 2 + 2) * 128, generator=g).to(dtype)
    q, w = qkv[:, :3 * 128].view(7, 3, 128), torch.randn(128, generator=g).to(dtype)
    assert _close(cuda.rms_norm(q, w, 1e-6), _rms_norm64(q, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dim", [12, 32])  # half 6: no pack divides it; half 16: packs
def test_rope_wide_and_narrow(dtype: torch.dtype, dim: int) -> None:
    g = torch.Generator().manual_seed(3)
    tokens, hq, hk = 5, 2, 1
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=g).to(dtype)
    q, k = qkv[:, :hq * dim], qkv[:, hq * dim:(hq + hk) * dim]
    positions = torch.tensor([0, 3, 9, 1, 15], dtype=torch.int64)
    inv = 1.0 / 10_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(16, dtype=torch.float64), inv)
    table = torch.cat([angles.cos(), angles.sin()], -1).float()
    a = angles[positions][:, None, :]
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    for x, got in zip((q, k), cuda.rope(positions, q, k, table, dim)):
        x = x.double().view(tokens, -1, dim)
        x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
        want = torch.cat([x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()], -1)
        assert torch.allclose(got.double().view_as(want), want, rtol=tol, atol=tol)


def _qk(dtype: torch.dtype, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q and k as views of a merged qkv (7 tokens, 3 q heads, 2 kv heads: 35 rows, not a
    multiple of 4 warps), their norms' weights, positions of both index types, a table."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(7, (3 + 2 * 2) * dim, generator=g) * 3).to(dtype)
    q, k = qkv[:, :3 * dim], qkv[:, 3 * dim:5 * dim]
    wq, wk = (torch.randn(dim, generator=g).to(dtype) for _ in range(2))
    inv = 1.0 / 10_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    table = torch.cat([table.cos(), table.sin()], -1).float()
    return q, k, wq, wk, torch.tensor([0, 5, 63, 2, 9, 40, 1]), table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dim", [32, 128])
@pytest.mark.parametrize("index", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_qk_norm_rope_is_the_three_kernels_bit_for_bit(dtype: torch.dtype, dim: int,
                                                       index: torch.dtype) -> None:
    """The fused launch against rms_norm of q's heads, of k's heads, then rope: the same bits
    on 16-byte packs and, one element off a boundary, on the narrow path, wherever rms_norm
    gives a head a warp (at most 64 loads a row: not float32 heads of 128 one by one, whose
    sum of squares it adds in another order, so equal there to float32 rounding)."""
    q, k, wq, wk, positions, table = _qk(dtype, dim, seed=dim + len(str(dtype)))
    positions = positions.to(index)
    for qq, kk, exact in ((q, k, True), (_unaligned(q), _unaligned(k),
                                         dtype == torch.bfloat16 or dim <= 64)):
        got = cuda.qk_norm_rope(positions, qq, kk, wq, wk, 1e-6, table)
        normed = (cuda.rms_norm(qq.view(7, 3, dim), wq, 1e-6),
                  cuda.rms_norm(kk.view(7, 2, dim), wk, 1e-6))
        want = cuda.rope(positions, *normed, table, dim)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            assert torch.equal(a, b) if exact else _close(a, b.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_qk_norm_rope_against_float64(dtype: torch.dtype) -> None:
    """Heads of 12 (half 6: no pack divides it): the norm and the rotation written out in
    float64."""
    dim = 12
    q, k, wq, wk, positions, table = _qk(dtype, dim, seed=4)
    angles = table.double()[positions][:, None, :]
    cos, sin = angles[..., :dim // 2], angles[..., dim // 2:]
    tol = 1e-5 if dtype == torch.float32 else 2 ** -5  # bf16: the norm's and rope's roundings
    for x, w, got in zip((q, k), (wq, wk), cuda.qk_norm_rope(positions, q, k, wq, wk, 1e-6,
                                                              table)):
        x = _rms_norm64(x.view(7, -1, dim), w)
        x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
        want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        assert torch.allclose(got.double().view_as(want), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_silu_and_mul_wide_and_narrow(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2 * 64, generator=g).to(dtype) * 4
    gate, up = x.double().chunk(2, -1)
    for xx in (x, _unaligned(x)):
        assert _close(cuda.silu_and_mul(xx), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dim", [6, 64])  # rows of 12 bytes (4-byte words); of 128 (16-byte)
def test_store_kv_wide_and_narrow(dim: int) -> None:
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.zeros(32, 1, dim, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(9, 1, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.randperm(32, generator=g)[:9].to(torch.int32)
    cuda.store_cache(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots.long()], k) and torch.equal(v_cache[slots.long()], v)
    assert int((k_cache != 0).any(-1).sum()) == 9  # nothing written outside the 9 slots


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    n = float(counts.sum())
    chi2 = float(((counts - expected * n) ** 2 / (expected * n)).sum())
    dof = torch.tensor((expected.numel() - 1) / 2)
    return float(torch.special.gammaincc(dof, torch.tensor(chi2 / 2)))


@pytest.mark.parametrize("vocab", [10, 12])  # one element a load; four
def test_sample_kernel_follows_the_float64_softmax(vocab: int) -> None:
    logits = torch.linspace(2.0, -3.0, vocab)
    expected = torch.softmax(logits.double() / 0.7, dim=-1)  # written here, in float64
    temps = torch.full((6000,), 0.7)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for step in range(2):  # 12,000 draws: the emulator runs a block per draw
        tokens = cuda.sample(logits.expand(6000, vocab), temps, seed=11, step=step)
        assert tokens.dtype == torch.int32
        counts += torch.bincount(tokens.long(), minlength=vocab).double()
    assert _p_value(counts, expected) > 1e-3


def test_sample_kernel_greedy_rows_impossible_tokens_and_its_random_numbers() -> None:
    """Temperature 1e-6 picks the argmax; a logit of -inf (probability 0) is never drawn; the
    same (seed, step) draws the same tokens, another step other ones."""
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), 0.5, 0.2, -1.0, 0.1],
                           [3.0, 2.9, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0]]).repeat(500, 1)
    temps = torch.tensor([1.0, 1e-6]).repeat(500)
    a = cuda.sample(logits, temps, seed=3, step=1)
    assert not torch.isin(a[0::2], torch.tensor([1, 3], dtype=torch.int32)).any()
    assert (a[1::2] == 0).all()
    assert torch.equal(a, cuda.sample(logits, temps, seed=3, step=1))
    assert not torch.equal(a, cuda.sample(logits, temps, seed=3, step=2))


def test_the_sampler_takes_the_kernel_without_a_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """MINISGL_KERNELS=cuda: no top-k or top-p, the kernel draws, a new step each time; a cut
    goes the sorted way of chapter 6."""
    monkeypatch.setenv("MINISGL_KERNELS", "cuda")
    kernel.mode.cache_clear()
    steps: list[int] = []
    draw = cuda.sample
    monkeypatch.setattr(cuda, "sample", lambda x, t, seed, step: steps.append(step) or draw(
        x, t, seed, step))
    try:
        sampler = Sampler(torch.device("cpu"), vocab_size=50, seed=0)
        reqs = [Req(torch.tensor([1], dtype=torch.int32), i, 0, 4, i, SamplingParams(
            temperature=0.6)) for i in range(3)]
        logits = torch.randn(3, 50)
        for _ in range(2):
            assert sampler.sample(logits, sampler.prepare(Batch(reqs, "decode"))).shape == (3,)
        assert steps == [1, 2]
        reqs[0].sampling_params = SamplingParams(temperature=0.6, top_p=0.9)
        monkeypatch.setattr(sample, "sample_from_probs", lambda *a: torch.zeros(3))
        assert sampler.sample(logits, sampler.prepare(Batch(reqs, "decode"))).sum() == 0
        assert steps == [1, 2]
    finally:
        kernel.mode.cache_clear()
