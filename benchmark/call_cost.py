"""The host's cost of calling one of our kernels (chapter 21).

On a CPU: builds a library whose functions have our kernels' names and return at once, opens
it the way kernel/cuda.py opens ours (the same ctypes argument types), and times each Python
wrapper of kernel/cuda.py at the shapes of one Qwen3-0.6B layer in a 650-token prefill. What
remains is the wrapper's work: the output's allocation, the data pointers, ctypes' conversion
of a dozen arguments. A C compiler is needed; the tensors are CPU tensors, so the allocations
are the CPU allocator's, not CUDA's caching allocator.

With --gpu: the real kernels on CUDA tensors, the GPU idle, beside the FlashInfer calls the
official makes in the same places (in place, as it calls them), the two sides timed in turns
(each goes first once), and beside torch.empty and F.linear: host microseconds per call, the
kernels' own time not waited for.

    python benchmark/call_cost.py [--gpu]
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from timing import cuda_ms, host_ms

from minisgl.kernel import cuda

NAMES = ("rms_norm", "rope", "qk_norm_rope", "silu_and_mul", "store_kv", "embedding", "sample")
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


def us_per_call(f: Callable[[], object], calls: int = 200, rounds: int = 30,
                sync: bool = False) -> float:
    """Median over rounds of the host time per call; with sync, the GPU drains between rounds
    (and not inside one), so no call waits for a full launch queue."""
    return 1e3 * host_ms(f, calls=calls, repeats=rounds, warmup=calls, sync=sync).median


def main() -> None:
    gpu = "--gpu" in sys.argv[1:]
    if not gpu:
        with tempfile.TemporaryDirectory() as tmp:
            lib = cuda.open_library(noop_library(Path(tmp)))
        cuda.load = lambda emulate: lib  # every wrapper now reaches the no-op functions
    bf16 = dict(dtype=torch.bfloat16, device="cuda" if gpu else "cpu")
    x, residual = torch.randn(TOKENS, HIDDEN, **bf16), torch.randn(TOKENS, HIDDEN, **bf16)
    weight, head_weight = torch.randn(HIDDEN, **bf16), torch.randn(HEAD, **bf16)
    q = torch.randn(TOKENS, QO_HEADS * HEAD, **bf16)
    k = torch.randn(TOKENS, KV_HEADS * HEAD, **bf16)
    dev = bf16["device"]  # not torch.set_default_device: its hook would slow every call timed
    table = torch.randn(4096, HEAD, device=dev)
    positions = torch.arange(TOKENS, dtype=torch.int32, device=dev)
    gate_up = torch.randn(TOKENS, 2 * INTER, **bf16)
    cache = torch.empty(4096, KV_HEADS, HEAD, **bf16)
    slots = torch.arange(TOKENS, dtype=torch.int32, device=dev)
    k_heads = k.view(TOKENS, KV_HEADS, HEAD)
    # one layer's calls, in the order a Qwen3 layer makes them (the three calls the fused
    # kernel replaced are timed apart by breakdown() on the GPU)
    layer = [("fused_add_rms_norm (input norm)",
              lambda: cuda.fused_add_rms_norm(x, residual, weight, 1e-6)),
             ("qk_norm_rope (norms + rope, one launch)",
              lambda: cuda.qk_norm_rope(positions, q, k, head_weight, head_weight, 1e-6, table)),
             ("store_cache", lambda: cuda.store_cache(cache, cache, slots, k_heads, k_heads)),
             ("fused_add_rms_norm (post-attention norm)",
              lambda: cuda.fused_add_rms_norm(x, residual, weight, 1e-6)),
             ("silu_and_mul", lambda: cuda.silu_and_mul(gate_up))]
    if gpu:
        return compare_on_gpu(layer, x, residual, weight, head_weight, q, k, positions, gate_up)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}: host us "
          f"per call of our kernel wrappers, the kernel a no-op ({TOKENS} tokens)")
    report(layer)


def report(calls: list[tuple[str, Callable[[], object]]], sync: bool = False) -> float:
    total = 0.0
    for name, f in calls:
        us = us_per_call(f, sync=sync)
        total += us
        print(f"  {name:42} {us:6.2f}")
    print(f"  {f'one layer ({len(calls)} calls)':42} {total:6.2f}")
    print(f"  {'28 layers':42} {28 * total / 1e3:6.2f} ms")
    return total


def compare_on_gpu(layer: list[tuple[str, Callable[[], object]]], x: torch.Tensor,
                   residual: torch.Tensor, weight: torch.Tensor, head_weight: torch.Tensor,
                   q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   gate_up: torch.Tensor) -> None:
    import flashinfer

    cos_sin = torch.randn(4096, HEAD, device=x.device)
    pos64 = positions.long()
    official = [
        ("fused_add_rmsnorm (input norm)",
         lambda: flashinfer.fused_add_rmsnorm(x, residual, weight, 1e-6)),
        ("rmsnorm in place (q heads)",
         lambda: flashinfer.rmsnorm(q.view(TOKENS, QO_HEADS, HEAD), head_weight, 1e-6,
                                    out=q.view(TOKENS, QO_HEADS, HEAD))),
        ("rmsnorm in place (k heads)",
         lambda: flashinfer.rmsnorm(k.view(TOKENS, KV_HEADS, HEAD), head_weight, 1e-6,
                                    out=k.view(TOKENS, KV_HEADS, HEAD))),
        ("apply_rope_with_cos_sin_cache_inplace",
         lambda: flashinfer.apply_rope_with_cos_sin_cache_inplace(
             positions=pos64, query=q, key=k, head_size=HEAD, cos_sin_cache=cos_sin)),
        ("fused_add_rmsnorm (post-attention norm)",
         lambda: flashinfer.fused_add_rmsnorm(x, residual, weight, 1e-6)),
        ("silu_and_mul", lambda: flashinfer.silu_and_mul(gate_up))]
    w_qkv = torch.randn((QO_HEADS + 2 * KV_HEADS) * HEAD, HIDDEN, dtype=x.dtype, device=x.device)
    torch_ops = [("torch.empty (one output)", lambda: torch.empty_like(x)),
                 ("F.linear (qkv, same rows)",
                  lambda: torch.nn.functional.linear(x, w_qkv))]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flashinfer "
          f"{flashinfer.__version__}: host us per call, the GPU idle ({TOKENS} tokens)")
    sides = [("ours (kernel/cuda.py, through ctypes)", layer),
             ("FlashInfer, as the official calls it (no store_cache: its kernel is the "
              "official's)", official)]
    for turn in range(2):  # in turns: whichever goes first on a fresh machine may pay for it
        for name, calls in sides if turn == 0 else sides[::-1]:
            print(f"{name}, turn {turn}:")
            report(calls, sync=True)
    print("torch:")
    report(torch_ops, sync=True)
    breakdown(x, head_weight, k)


def breakdown(x: torch.Tensor, weight: torch.Tensor, k: torch.Tensor) -> None:
    """One call (rms_norm over k's heads) taken apart: the whole wrapper, the bare library call
    with its arguments made once, the same call into a no-op library (ctypes alone on this
    CPU), the output's allocation; and each kernel's GPU time (CUDA events, 200 calls)."""
    import flashinfer

    # fresh inputs: the timings above ran FlashInfer's rope in place thousands of times with a
    # random table, which is no rotation, so q and k hold infinities by now
    k = torch.randn_like(k)
    heads = k.view(TOKENS, KV_HEADS, HEAD)
    q_heads = torch.randn(TOKENS, QO_HEADS, HEAD, dtype=k.dtype, device=k.device)
    out = torch.empty_like(heads)
    lib = cuda.load(False)
    with tempfile.TemporaryDirectory() as tmp:
        noop = cuda.open_library(noop_library(Path(tmp)))
    stream = torch.cuda.current_stream().cuda_stream
    args = (out.data_ptr(), None, heads.data_ptr(), None, weight.data_ptr(),
            cuda.DTYPES[heads.dtype], *cuda._rows(heads), HEAD, 1e-6, stream)
    angles = torch.outer(torch.arange(4096.0), 1e4 ** -torch.arange(0, 1, 2 / HEAD)).to(x.device)
    table = torch.cat([angles.cos(), angles.sin()], -1)
    positions = torch.arange(TOKENS, dtype=torch.int32, device=x.device)
    parts = [("the wrapper, cuda.rms_norm", lambda: cuda.rms_norm(heads, weight, 1e-6)),
             ("rms_norm, rms_norm, rope: the unfused three",
              lambda: cuda.rope(positions, cuda.rms_norm(q_heads, weight, 1e-6),
                                cuda.rms_norm(heads, weight, 1e-6), table, HEAD)),
             ("bare lib.rms_norm, arguments made once", lambda: lib.rms_norm(*args)),
             ("no-op library, the same arguments", lambda: noop.rms_norm(*args)),
             ("torch.empty_like (the output)", lambda: torch.empty_like(heads)),
             ("flashinfer.rmsnorm, out given",
              lambda: flashinfer.rmsnorm(heads, weight, 1e-6, out=out))]
    fused = cuda.qk_norm_rope(positions, q_heads.view(TOKENS, -1), k, weight, weight, 1e-6, table)
    unfused = parts[1][1]()
    for name, a, b in zip("qk", fused, unfused):
        b = b.view_as(a)
        differ = (a != b).nonzero()
        print(f"qk_norm_rope vs rms_norm, rms_norm, rope, {name}: {len(differ)} of {a.numel()} "
              f"elements differ, max |difference| {(a.float() - b.float()).abs().max().item():.3g}"
              f"; first at {differ[:3].tolist()}")
    print("one call taken apart (rms_norm, k heads): host us per call")
    for name, f in parts:
        print(f"  {name:42} {us_per_call(f, sync=True):6.2f}")
    print("GPU us per kernel (CUDA events over 200 calls):")
    for name, f in (parts[2], parts[5]):
        print(f"  {name:42} {1e3 * cuda_ms(f, calls=200, repeats=1).median:6.2f}")


if __name__ == "__main__":
    main()
