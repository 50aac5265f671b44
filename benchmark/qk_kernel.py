"""Chapter 21's fused q/k norm + rope kernel against an older build of it, on a GPU: equal bits
(to the older build, and to rms_norm, rms_norm, rope), then microseconds per call; then every
other kernel (tools/gpu_common.py's kernel_cases) the same way, old and new in turns.

    git archive REV python/minisgl/kernel/csrc | tar -x -C /tmp/old   # the older sources
    python benchmark/qk_kernel.py /tmp/old/python/minisgl/kernel/csrc

Qwen3-0.6B's shape (16 q heads, 8 k heads of 128, bf16); T tokens at random positions. A call is
timed as the mean of 200 back to back (CUDA events, median and range of 5): at a few tokens that
is the host's launch cost, not the kernel's. The flashinfer column is rmsnorm, rmsnorm and rope on
`reshape`d q and k, which copies the strided views first: not the official engine's cost."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from timing import cuda_ms, graph_ms

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tools")]
from gpu_common import kernel_cases  # noqa: E402

from minisgl.kernel import cuda  # noqa: E402

D, HQ, HK, DEV = 128, 16, 8, "cuda"


def use(lib: object) -> None:
    cuda.load = lambda emulate: lib  # every launch in cuda.py goes through load()


def timed(fn: Callable[[], object], n: int = 200) -> tuple[float, float, float]:
    """Microseconds per call: median, min and max of 5 timings of n back-to-back calls."""
    return cuda_ms(fn, calls=n, repeats=5, warmup=10).scaled(1e3)


def main() -> None:
    t0 = time.time()
    new = cuda.open_library(cuda.build(False))
    old = cuda.open_library(cuda.build(False, Path(sys.argv[1])))
    print(f"built both in {time.time() - t0:.0f} s", flush=True)
    torch.manual_seed(0)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.arange(40960, dtype=torch.float32)[:, None] * inv[None]
    table = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEV)
    wq, wk = (torch.randn(D, device=DEV).to(torch.bfloat16) for _ in range(2))
    try:
        import flashinfer
    except ImportError as e:
        flashinfer = None
        print("no flashinfer", e)
    for T in (1, 16, 256, 2048, 16000):
        qkv = torch.randn(T, (HQ + 2 * HK) * D, device=DEV).to(torch.bfloat16)
        q, k = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D]
        pos = torch.randint(0, 40000, (T,), device=DEV, dtype=torch.int32)

        def fused(q: torch.Tensor = q, k: torch.Tensor = k,
                  pos: torch.Tensor = pos) -> tuple[torch.Tensor, torch.Tensor]:
            return cuda.qk_norm_rope(pos, q, k, wq, wk, 1e-6, table)

        outs = {}
        for name, lib in (("old", old), ("new", new)):
            use(lib)
            outs[name] = fused()
        use(new)
        three = cuda.rope(pos, cuda.rms_norm(q.reshape(T, HQ, D), wq, 1e-6),
                          cuda.rms_norm(k.reshape(T, HK, D), wk, 1e-6), table, D)
        eq_old = all(torch.equal(a, b) for a, b in zip(outs["new"], outs["old"]))
        eq_three = all(torch.equal(a.reshape(-1), b.reshape(-1))
                       for a, b in zip(outs["new"], three))
        row = [f"T={T:>6}", f"new==old {eq_old}", f"new==rms_norm,rms_norm,rope {eq_three}"]
        for name, lib in (("old", old), ("new", new)):
            use(lib)
            m, lo, hi = timed(fused)
            row.append(f"{name} {m:.1f} us ({lo:.1f}-{hi:.1f})")
        use(new)
        if flashinfer is not None:
            def fi(q: torch.Tensor = q, k: torch.Tensor = k, pos: torch.Tensor = pos,
                   T: int = T) -> None:
                qn = flashinfer.norm.rmsnorm(q.reshape(-1, D), wq, 1e-6)
                kn = flashinfer.norm.rmsnorm(k.reshape(-1, D), wk, 1e-6)
                flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                    pos, qn.view(T, -1), kn.view(T, -1), D, table, True)
            try:
                m, lo, hi = timed(fi)
                row.append(f"flashinfer norm,norm,rope {m:.1f} us ({lo:.1f}-{hi:.1f})")
            except Exception as e:  # noqa: BLE001 (a diagnostic column)
                row.append(f"flashinfer failed: {str(e)[:80]}")
        print(" | ".join(row), flush=True)
    every_kernel(old, new)


def every_kernel(old: object, new: object) -> None:
    """Each case of kernel_cases in bfloat16 at T tokens: the outputs of the old and the new
    build from the same inputs (equal bits?), then GPU microseconds per call from CUDA graphs of
    50 calls, the two builds in turns, median and range of 11 rounds."""
    print("every kernel, bfloat16: GPU us per call (graph of 50), old and new in turns, "
          "median (min-max) of 11", flush=True)
    for t in (1, 64, 4096, 16000):
        outs = {}
        for name, lib in (("old", old), ("new", new)):
            use(lib)  # the same inputs; in-place kernels see their first call's values
            outs[name] = {case: run() for case, (run, _, _) in kernel_cases(torch.bfloat16,
                                                                              t).items()}
        for case, (run, _, nbytes) in kernel_cases(torch.bfloat16, t).items():
            a, b = outs["old"][case], outs["new"][case]
            pairs = list(zip(a, b)) if isinstance(a, tuple) else [(a, b)]
            same = "-" if a is None else all(torch.equal(x, y) for x, y in pairs)
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(11):
                for name, lib in (("old", old), ("new", new)):
                    use(lib)
                    times[name].append(graph_ms(run) * 1e3)
            row = [f"T={t:>6}", f"{case:<26}", f"new==old {same}"]
            for name in ("old", "new"):
                x = sorted(times[name])
                row.append(f"{name} {x[5]:8.2f} us ({x[0]:.2f}-{x[-1]:.2f})")
            row.append(f"new {nbytes / x[5] / 1e3:5.0f} GB/s")
            print(" | ".join(row), flush=True)
        use(new)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
