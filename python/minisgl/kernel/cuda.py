"""Our CUDA kernels (csrc/kernels.cu, chapter 19), built on first use and cached: with nvcc for the
GPU, or with a host C++ compiler over the CPU emulator (csrc/emu.h) for checking on a CPU.

The library is a plain shared object with C entry points, called through ctypes with raw
pointers and the current CUDA stream: no torch headers to compile against, so a build takes
seconds, and one source serves both the GPU and the emulator."""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("kernels.cu", "launch.h", "emu.h")


def cache_dir() -> Path:
    root = os.environ.get("MINISGL_KERNEL_CACHE") or Path.home() / ".cache" / "minisgl"
    return Path(root) / "kernels"


def build_command(emulate: bool, src: Path, out: Path, arch: str | None = None) -> list[str]:
    """The compiler's command line: g++ for the emulator, or nvcc for `arch` (sm_90 and such;
    by default this machine's GPU)."""
    if emulate:
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise RuntimeError("the CPU emulator of our CUDA kernels needs a C++17 compiler "
                               "(g++): install it, or set CXX")
        return [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-DMINISGL_EMULATE",
                "-x", "c++", str(src), "-o", str(out)]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("our CUDA kernels are compiled on first use and need nvcc (the CUDA "
                           "toolkit) on PATH: install it, or set MINISGL_KERNELS=torch")
    arch = arch or "sm_{}{}".format(*torch.cuda.get_device_capability())
    # no fused multiply-add: the products round as torch's separate ops round them
    return [nvcc, "-std=c++17", "-O3", "-fmad=false", "-shared", "-Xcompiler", "-fPIC",
            f"-arch={arch}", str(src), "-o", str(out)]


def build(emulate: bool, csrc: Path = CSRC) -> Path:
    """Compile csrc/kernels.cu, once per source version, compiler mode and GPU generation;
    returns the shared library's path in the cache."""
    # the key: the sources and the compiler's command line (a changed flag builds anew)
    flags = " ".join(build_command(emulate, Path("kernels.cu"), Path("out"))).encode()
    digest = hashlib.sha256(b"".join((csrc / s).read_bytes() for s in SOURCES) + flags)
    tag = "emu" if emulate else "sm{}{}".format(*torch.cuda.get_device_capability())
    out = cache_dir() / f"kernels-{tag}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = build_command(emulate, csrc / "kernels.cu", tmp)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"building our CUDA kernels failed ({' '.join(cmd[:1])}):\n"
                               f"{done.stderr[-3000:]}")
        tmp.replace(out)  # atomic: a concurrent builder finds a whole file or none
    return out


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i32, i64, u64, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float
    ptr = ctypes.c_void_p
    lib.error_string.argtypes, lib.error_string.restype = [i32], ctypes.c_char_p
    lib.store_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i64, i64, i64, i64, ptr]
    lib.embedding.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    lib.rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i64, i64, i64, i64, i64, f32, ptr]
    lib.rope.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i64, i64, i64, i32, i32, i32,
                         ptr]
    lib.qk_norm_rope.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i64, i64,
                                 i64, i32, i32, i32, f32, ptr]
    lib.silu_and_mul.argtypes = [ptr, ptr, i32, i64, i64, ptr]
    lib.sample.argtypes = [ptr, ptr, ptr, i32, i64, i64, i64, u64, u64, ptr]
    return lib


@cache
def load(emulate: bool) -> ctypes.CDLL:
    """The library for the GPU (nvcc) or for the CPU emulator (a host compiler)."""
    return open_library(build(emulate))


DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # what the kernels compute in (kernels.cu)


# The current stream's raw handle in one call: the function torch's own compiler emits.
# torch.cuda.current_stream() builds a Stream object and resolves the device first, which
# cost more than the launch itself, some 200 times in one prefill.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _call(t: torch.Tensor, name: str, *args: object) -> None:
    """Launch kernel `name` on t's device (the emulator for a CPU tensor), on the current
    stream; a failed launch raises with the CUDA (or emulator) reason."""
    if t.is_cuda:
        lib = load(False)
        stream = (_raw_stream(t.get_device()) if _raw_stream is not None
                  else torch.cuda.current_stream(t.device).cuda_stream)
    else:
        lib, stream = load(True), None
    code = getattr(lib, name)(*args, stream)
    if code != 0:
        raise RuntimeError(f"kernel {name} failed: {lib.error_string(code).decode()}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    """Row i of k and v ([T, H, D], each token's H*D contiguous) into slot indices[i] of the
    [slots, H, D] caches; the contract of reference.store_cache."""
    row = k_cache.stride(0) * k_cache.element_size()  # the cache is contiguous (below)
    for x in (k, v):
        assert x.stride(-1) == 1 and x.stride(-2) == x.shape[-1], "heads must be contiguous"
    assert k_cache.is_contiguous() and indices.dtype in (torch.int32, torch.int64)
    assert row % 4 == 0, "rows are copied as 32-bit words"
    size = k.element_size()
    _call(k, "store_kv", k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
          indices.data_ptr(), indices.element_size(), len(indices), row, k.stride(0) * size,
          v.stride(0) * size)


def embedding(ids: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
    """weight[ids - start] for the ids in [start, start + len(weight)), zero rows elsewhere."""
    assert ids.dtype == torch.int32 and weight.is_contiguous()
    out = torch.empty(len(ids), weight.shape[1], dtype=weight.dtype, device=weight.device)
    _call(weight, "embedding", out.data_ptr(), weight.data_ptr(), ids.data_ptr(), len(ids),
          start, weight.shape[0], weight.shape[1] * weight.element_size())
    return out


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x as rows of its last dim, for [T, D] or [T, H, D] views with contiguous rows:
    (rows, inner, outer_stride, inner_stride); row r starts at
    (r // inner) * outer_stride + (r % inner) * inner_stride."""
    assert x.stride(-1) == 1 and x.dim() in (2, 3)
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


# Outputs are allocated with empty_like in contiguous format: torch.empty(x.shape, dtype=...,
# device=x.device) builds a Size and a device object first, and a host microsecond a call adds
# up over the ~200 calls of a prefill.
CONTIGUOUS = torch.contiguous_format


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=CONTIGUOUS)
    _call(x, "rms_norm", out.data_ptr(), None, x.data_ptr(), None, weight.data_ptr(),
          DTYPES[x.dtype], *_rows(x), x.shape[-1], eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in one pass and in place, as FlashInfer's: the sum
    goes into residual, its norm into x, and those two are returned. Nothing is allocated: a
    prefill makes two of these calls a layer, and allocating their outputs would be half the
    host allocations of its forward."""
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
    _call(x, "rms_norm", x.data_ptr(), residual.data_ptr(), x.data_ptr(), residual.data_ptr(),
          weight.data_ptr(), DTYPES[x.dtype], *_rows(x), x.shape[-1], eps)
    return x, residual


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor,
         head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq*D] (or [T, Hq, D]) and k rotated by position; returns new contiguous
    [T, Hq*D] and [T, Hk*D], as reference.apply_rope does. table: [max_position, D] float32."""
    for x in (q, k):
        assert x.stride(-1) == 1 and (x.dim() == 2 or x.stride(1) == head_dim)
    assert table.dtype == torch.float32 and positions.dtype in (torch.int32, torch.int64)
    tokens, hq, hk = q.shape[0], math.prod(q.shape[1:]) // head_dim, \
        math.prod(k.shape[1:]) // head_dim
    q_out = torch.empty(tokens, hq * head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, hk * head_dim, dtype=k.dtype, device=k.device)
    _call(q, "rope", q_out.data_ptr(), k_out.data_ptr(), q.data_ptr(), k.data_ptr(),
          table.data_ptr(), positions.data_ptr(), DTYPES[q.dtype], positions.element_size(),
          tokens, q.stride(0), k.stride(0), hq, hk, head_dim)
    return q_out, k_out


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope(positions, rms_norm(q heads, q_weight), rms_norm(k heads, k_weight)) in one launch,
    equal to those three calls: q [T, Hq*D] and k [T, Hk*D] (views of the merged qkv), table
    [max_position, D] float32; returns new contiguous [T, Hq*D] and [T, Hk*D]."""
    head_dim = table.shape[-1]
    for x in (q, k):
        assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] % head_dim == 0
    assert table.dtype == torch.float32 and positions.dtype in (torch.int32, torch.int64)
    tokens = q.shape[0]
    q_out = torch.empty_like(q, memory_format=CONTIGUOUS)
    k_out = torch.empty_like(k, memory_format=CONTIGUOUS)
    _call(q, "qk_norm_rope", q_out.data_ptr(), k_out.data_ptr(), q.data_ptr(), k.data_ptr(),
          q_weight.data_ptr(), k_weight.data_ptr(), table.data_ptr(), positions.data_ptr(),
          DTYPES[q.dtype], positions.element_size(), tokens, q.stride(0), k.stride(0),
          q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim, eps)
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.is_contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    _call(x, "silu_and_mul", out.data_ptr(), x.data_ptr(), DTYPES[x.dtype], x.numel() // (2 * d),
          d)
    return out


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """One int32 token per row of logits [bs, vocab], drawn from softmax(logits / temperature)
    in one pass (Gumbel-max); (seed, step, row) picks the random numbers, so a
    sampler passes a new step for every draw."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    assert temperatures.dtype == torch.float32 and temperatures.is_contiguous()
    out = torch.empty(len(logits), dtype=torch.int32, device=logits.device)
    _call(logits, "sample", out.data_ptr(), logits.data_ptr(), temperatures.data_ptr(),
          DTYPES[logits.dtype], len(logits), logits.stride(0), logits.shape[-1], seed, step)
    return out
