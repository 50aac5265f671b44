"""Our CUDA kernels (csrc/kernels.cu), built on first use and cached: with nvcc for the GPU, or
with a host C++ compiler over the CPU emulator (csrc/emu.h) for checking on a CPU (chapter 19).

The library is a plain shared object with C entry points, called through ctypes with raw
pointers and the current CUDA stream: no torch headers to compile against, so a build takes
seconds, and one source serves both the GPU and the emulator."""

from __future__ import annotations

import ctypes
import hashlib
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


def build_command(emulate: bool, out: Path) -> list[str]:
    src = str(CSRC / "kernels.cu")
    if emulate:
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise RuntimeError("the CPU emulator of our CUDA kernels needs a C++17 compiler "
                               "(g++): install it, or set CXX")
        return [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-DMINISGL_EMULATE",
                "-x", "c++", src, "-o", str(out)]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("our CUDA kernels are compiled on first use and need nvcc (the CUDA "
                           "toolkit) on PATH; without it, use the torch reference kernels")
    major, minor = torch.cuda.get_device_capability()
    return [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC",
            f"-arch=sm_{major}{minor}", src, "-o", str(out)]


@cache
def load(emulate: bool) -> ctypes.CDLL:
    """Build (once per source version, compiler mode and GPU) and load the library."""
    digest = hashlib.sha256(b"".join((CSRC / s).read_bytes() for s in SOURCES))
    tag = "emu" if emulate else "sm{}{}".format(*torch.cuda.get_device_capability())
    out = cache_dir() / f"kernels-{tag}-{digest.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = build_command(emulate, tmp)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"building our CUDA kernels failed ({' '.join(cmd[:1])}):\n"
                               f"{done.stderr[-3000:]}")
        tmp.replace(out)  # atomic: a concurrent builder finds a whole file or none
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.store_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, i64, i64, ptr]
    lib.embedding.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ptr]
    return lib


def _stream(t: torch.Tensor) -> int | None:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def store_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> None:
    """Row i of k and v into slot indices[i] of the [slots, H, D] caches; same contract as
    reference.store_cache."""
    row = k_cache[0].numel() * k_cache.element_size()
    assert k.is_contiguous() and v.is_contiguous() and k_cache.is_contiguous()
    assert indices.dtype in (torch.int32, torch.int64) and row % 4 == 0
    load(not k.is_cuda).store_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(),
                                 v.data_ptr(), indices.data_ptr(), indices.element_size(),
                                 len(indices), row, _stream(k))


def embedding(ids: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
    """weight[ids - start] for the ids in [start, start + len(weight)), zero rows elsewhere."""
    assert ids.dtype == torch.int32 and weight.is_contiguous()
    out = torch.empty(len(ids), weight.shape[1], dtype=weight.dtype, device=weight.device)
    load(not weight.is_cuda).embedding(out.data_ptr(), weight.data_ptr(), ids.data_ptr(),
                                       len(ids), start, weight.shape[0], weight.shape[1],
                                       weight.element_size(), _stream(weight))
    return out
