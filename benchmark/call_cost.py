"""The host's cost of calling one of our kernels, the kernel itself left out (chapter 21).

Builds a library whose functions have our kernels' names and return at once, opens it the way
kernel/cuda.py opens ours (the same ctypes argument types), and times each Python wrapper of
kernel/cuda.py at the shapes of one Qwen3-0.6B layer in a 650-token prefill. What remains is
the wrapper's work: the output's allocation, the data pointers, ctypes' conversion of a dozen
arguments. Runs on a CPU (a C compiler is needed); the tensors are CPU tensors, so the
allocations are the CPU allocator's, not CUDA's caching allocator.

    python benchmark/call_cost.py
"""

from __future__ import annotations

import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minisgl.kernel import cuda

NAMES = ("rms_norm", "rope", "silu_and_mul", "store_kv", "embedding", "sample")
TOKENS, HIDDEN, HEAD, QO_HEADS, KV_HEADS, INTER = 650, 1024, 128, 16, 8, 3072


def noop_library(folder: Path) -> Path:
    src, out = folder / "noop.c", folder / "libnoop.so"
    src.write_text("".join(f"int {n}(void) {{ return 0; }}\n" for n in NAMES)
                   + 'const char *error_string(int c) { return ""; }\n')
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("needs a C compiler (cc or gcc) on PATH")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", str(src), "-o", str(out)], check=True)
    return out


def us_per_call(f: Callable[[], object], calls: int = 200, rounds: int = 30) -> float:
    for _ in range(calls):
        f()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append(1e6 * (time.perf_counter() - t) / calls)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lib = cuda.open_library(noop_library(Path(tmp)))
    cuda.load = lambda emulate: lib  # every wrapper now reaches the no-op functions
    bf16 = dict(dtype=torch.bfloat16)
    x, residual = torch.randn(TOKENS, HIDDEN, **bf16), torch.randn(TOKENS, HIDDEN, **bf16)
    weight, head_weight = torch.randn(HIDDEN, **bf16), torch.randn(HEAD, **bf16)
    q = torch.randn(TOKENS, QO_HEADS * HEAD, **bf16)
    k = torch.randn(TOKENS, KV_HEADS * HEAD, **bf16)
    table, positions = torch.randn(4096, HEAD), torch.arange(TOKENS, dtype=torch.int32)
    gate_up = torch.randn(TOKENS, 2 * INTER, **bf16)
    cache = torch.empty(4096, KV_HEADS, HEAD, **bf16)
    slots = torch.arange(TOKENS, dtype=torch.int32)
    k_heads = k.view(TOKENS, KV_HEADS, HEAD)
    # one layer's calls, in the order a Qwen3 layer makes them
    layer = [("fused_add_rms_norm (input norm)",
              lambda: cuda.fused_add_rms_norm(x, residual, weight, 1e-6)),
             ("rms_norm (q heads)",
              lambda: cuda.rms_norm(q.view(TOKENS, QO_HEADS, HEAD), head_weight, 1e-6)),
             ("rms_norm (k heads)", lambda: cuda.rms_norm(k_heads, head_weight, 1e-6)),
             ("rope", lambda: cuda.rope(positions, q, k, table, HEAD)),
             ("store_cache", lambda: cuda.store_cache(cache, cache, slots, k_heads, k_heads)),
             ("fused_add_rms_norm (post-attention norm)",
              lambda: cuda.fused_add_rms_norm(x, residual, weight, 1e-6)),
             ("silu_and_mul", lambda: cuda.silu_and_mul(gate_up))]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}: host us "
          f"per call of our kernel wrappers, the kernel a no-op ({TOKENS} tokens)")
    total = 0.0
    for name, f in layer:
        us = us_per_call(f)
        total += us
        print(f"  {name:42} {us:6.2f}")
    print(f"  {'one layer (7 calls)':42} {total:6.2f}")
    print(f"  {'28 layers':42} {28 * total / 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
