"""Chapter 19: our CUDA kernels, compiled by nvcc, and run on the CPU emulator against plain-torch
references written here (not our reference module). The same kernels on the H200 are checked by
tests/gpu/test_gpu_kernels.py (times: benchmark/gpu_bench.py kernels)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import kernel
from minisgl.core import SamplingParams
from minisgl.kernel import cuda

from helpers import fake_gpu_libraries, shell_session
from reference import assert_aligned, hf_greedy

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """One build of the emulator per test session, in the session's temporary folder."""
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))


def emulated(run: Callable[[], Any]) -> Any:
    """Run a kernel on the emulator; a kernel it cannot run is a skip that says so, never a
    pass."""
    try:
        return run()
    except RuntimeError as e:
        if "emulator cannot run" in str(e):
            pytest.skip(str(e))
        raise


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: to float32 rounding; bfloat16: to two roundings (an intermediate and the result
    are stored in bfloat16, each within 2^-9 relative), with some slack."""
    tol = 1e-5 if got.dtype == torch.float32 else 2 ** -7
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_nvcc_compiles_the_same_source(tmp_path: Path) -> None:
    cmd = cuda.build_command(False, cuda.CSRC / "kernels.cu", tmp_path / "k.so", arch="sm_90")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_store_kv(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    slots, heads, dim, n = 64, 2, 24, 37  # 37 tokens: not a multiple of the 4 warps a block has
    k_cache = torch.randn(slots, heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, heads, dim, generator=g).to(dtype)
    k = torch.randn(n, heads, dim, generator=g).to(dtype)
    # v as the attention layer hands it over: a slice of the merged qkv, rows 3 heads apart
    v = torch.randn(n, 3 * heads * dim, generator=g).to(dtype)[:, :heads * dim].view(n, heads, dim)
    indices = torch.randperm(slots, generator=g)[:n].to(index_dtype)
    indices[:2] = torch.tensor([0, slots - 1])  # the first and last slot
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, s in enumerate(indices.tolist()):
        want_k[s], want_v[s] = k[i], v[i]
    emulated(lambda: cuda.store_cache(k_cache, v_cache, indices, k, v))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("start,rows", [(0, 50), (50, 50), (37, 13)])
def test_embedding_of_a_vocabulary_range(dtype: torch.dtype, start: int, rows: int) -> None:
    g = torch.Generator().manual_seed(1)
    vocab, hidden = 100, 40
    full = torch.randn(vocab, hidden, generator=g).to(dtype)
    # the range's edges and their neighbours, then random ids
    ids = torch.tensor([start - 1, start, start + rows - 1, start + rows, 0, vocab - 1]
                       + torch.randint(0, vocab, (20,), generator=g).tolist())
    ids = ids.clamp(0, vocab - 1).to(torch.int32)
    want = torch.stack([full[i] if start <= i < start + rows else torch.zeros(hidden, dtype=dtype)
                        for i in ids.tolist()])
    got = emulated(lambda: cuda.embedding(ids, full[start:start + rows].contiguous(), start))
    assert torch.equal(got, want)


def _rms_norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("cols", [64, 200, 1536])  # 1536: 384 threads, more than a warp's sum
def test_rms_norm(dtype: torch.dtype, cols: int) -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, cols, generator=g).to(dtype), torch.randn(cols, generator=g).to(dtype)
    _close(emulated(lambda: cuda.rms_norm(x, w, 1e-6)), _rms_norm64(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_rms_norm_of_heads_inside_the_merged_qkv(dtype: torch.dtype) -> None:
    """Qwen3's q_norm: each [D] head of q, a strided [T, H, D] view of qkv, normalised."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, dim = 5, 4, 32
    qkv = torch.randn(tokens, (heads + 2 + 2) * dim, generator=g).to(dtype)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    w = torch.randn(dim, generator=g).to(dtype)
    assert not q.is_contiguous()
    _close(emulated(lambda: cuda.rms_norm(q, w, 1e-6)), _rms_norm64(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(7, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype)
    normed, total = emulated(lambda: cuda.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6))
    want_total = (x.double() + r.double()).to(dtype)  # the sum, rounded once
    assert torch.equal(total, want_total)
    _close(normed, _rms_norm64(want_total, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_rope(dtype: torch.dtype) -> None:
    """Against the rotation written out with angles in float64: pairs (j, j + D/2) of each head
    of q and k, at positions that include 0 and the table's last row."""
    g = torch.Generator().manual_seed(5)
    tokens, hq, hk, dim, base, max_pos = 6, 4, 2, 16, 10_000.0, 64
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=g).to(dtype)
    q, k = qkv[:, :hq * dim], qkv[:, hq * dim:(hq + hk) * dim]  # strided views, as in the layer
    positions = torch.tensor([0, 1, 7, 30, 5, max_pos - 1], dtype=torch.int32)
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    table = torch.cat([angles.cos(), angles.sin()], -1).float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.double().view(tokens, -1, dim)
        a = angles[positions.long()][:, None, :]
        x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
        return torch.cat([x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()], -1)

    q_out, k_out = emulated(lambda: cuda.rope(positions, q, k, table, dim))
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6  # bf16: cos, sin and products rounded
    for got, want in ((q_out, rotate(q)), (k_out, rotate(k))):
        assert torch.allclose(got.double().view_as(want), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 2 * 300, generator=g).to(dtype) * 4  # 1500 outputs: more than one block
    gate, up = x.double().chunk(2, -1)
    _close(emulated(lambda: cuda.silu_and_mul(x)), gate * torch.sigmoid(gate) * up)


def _library_with(tmp_path: Path, find: str, replace: str) -> Any:
    """The emulator built from a copy of csrc/ with one edit: a planted bug."""
    csrc = tmp_path / "csrc"
    shutil.copytree(cuda.CSRC, csrc)
    source = (csrc / "kernels.cu").read_text()
    assert find in source
    (csrc / "kernels.cu").write_text(source.replace(find, replace))
    return cuda.open_library(cuda.build(True, csrc))


def test_a_missing_barrier_is_a_wrong_answer_not_a_rare_race(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without __syncthreads, warp 0 reads the other warps' partial sums before they are
    written. On a GPU that is a race that may pass for months; the emulator runs the threads in
    order, so it is wrong every time."""
    lib = _library_with(tmp_path, "  __syncthreads();  // all partials written before any warp",
                        "  // all partials written before any warp")
    monkeypatch.setattr(cuda, "load", lambda emulate: lib)
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 1024, generator=g), torch.randn(1024, generator=g)
    assert not torch.allclose(cuda.rms_norm(x, w, 1e-6).double(), _rms_norm64(x, w, 1e-6))


def test_a_kernel_the_emulator_cannot_run_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that return before the block's reduction leave the others at a barrier nobody
    else reaches: the emulator says it cannot run that, and emulated() turns it into a skip."""
    lib = _library_with(tmp_path, "  float squares = 0.0f;",
                        "  if (threadIdx.x >= 32) return;\n  float squares = 0.0f;")
    monkeypatch.setattr(cuda, "load", lambda emulate: lib)
    x, w = torch.randn(2, 1024), torch.randn(1024)
    with pytest.raises(RuntimeError, match="emulator cannot run this kernel"):
        cuda.rms_norm(x, w, 1e-6)


@pytest.fixture
def emulated_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """MINISGL_KERNELS=cuda for this test: every kernel call of the engine goes to ours, on the
    emulator."""
    monkeypatch.setenv("MINISGL_KERNELS", "cuda")
    kernel.mode.cache_clear()
    yield
    kernel.mode.cache_clear()


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fake flashinfer and sgl_kernel of chapter 17 on the import path."""
    with fake_gpu_libraries(monkeypatch):
        yield


@pytest.mark.parametrize("arch,cache_type,attn", [
    ("tiny-qwen3", "radix", "torch"), ("tiny-llama", "naive", "torch"),
    ("tiny-qwen2", "radix", "torch"), ("tiny-mistral", "radix", "torch"),
    ("tiny-qwen3", "radix", "fa,fi")])  # the backends' fakes read what our kernels wrote
def test_the_engine_on_emulated_kernels_gives_hf_tokens(
        arch: str, cache_type: str, attn: str, emulated_kernels: None, make_llm: Callable,
        model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """Every architecture with our kernels (q/k norms, rotary, SwiGLU, paged KV): HF's tokens
    and logits at every step, and each kernel was called."""
    if attn != "torch":
        request.getfixturevalue("fakes")
    path = model_dir(arch)
    calls: set[str] = set()
    call = cuda._call
    monkeypatch.setattr(cuda, "_call", lambda t, name, *a: calls.add(name) or call(t, name, *a))
    llm = make_llm(path, cache_type=cache_type, attention_backend=attn)
    seen: list[torch.Tensor] = []
    sample = llm.engine.sampler.sample
    llm.engine.sampler.sample = lambda logits, args: seen.append(logits[0].clone()) or sample(
        logits, args)
    prompt = [5, 80, 200, 31, 7, 99, 13]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
    assert_aligned(out[0]["token_ids"], seen, *hf_greedy(path, prompt, 16))
    # the embedding of the whole table stays torch's (one gather; ours did not pay on the H200);
    # Qwen3's q/k norms and its rotation are one launch (chapter 21)
    rotation = "qk_norm_rope" if arch == "tiny-qwen3" else "rope"
    assert calls == {"store_kv", "rms_norm", rotation, "silu_and_mul"}


def test_the_shell_on_emulated_kernels(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """`MINISGL_KERNELS=cuda python -m minisgl --shell`: the scheduler process says which
    kernels it runs, and answers."""
    stderr = shell_session(model_dir("tiny-qwen3"), tmp_path, MINISGL_KERNELS="cuda")
    assert "kernels: ours, on the CPU emulator (MINISGL_KERNELS=cuda)" in stderr
