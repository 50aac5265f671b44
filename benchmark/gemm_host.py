"""The host's time per cuBLAS matmul when the row count changes every call, as a prefill's does
(chapter 21): bf16 F.linear on the four projection shapes of Qwen3-0.6B, 28 calls per batch,
row counts fixed, new each batch, and new but rounded up to a multiple of 64. Needs a GPU.

    python benchmark/gemm_host.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down


def host_us_per_call(weights: list[torch.Tensor], x: torch.Tensor, rows: list[int],
                     align: int = 1) -> float:
    """Median over batches of the host's microseconds per F.linear call (launch only: the GPU
    keeps up with these sizes, so the loop never waits for it)."""
    times = []
    for m in rows:
        m = -(-m // align) * align
        torch.cuda.synchronize()
        t = time.perf_counter()
        for w in weights:
            for _ in range(7):
                F.linear(x[:m, : w.shape[1]], w)
        times.append(1e6 * (time.perf_counter() - t) / (7 * len(weights)))
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    draw = random.Random(0)
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) for o, i in SHAPES]
    x = torch.randn(9000, 3072, device="cuda", dtype=torch.bfloat16)
    host_us_per_call(weights, x, [600] * 20)  # warm up
    cases = [("rows fixed at 650", [650] * 200, 1),
             ("rows new each batch (300-900)", [draw.randint(300, 900) for _ in range(200)], 1),
             ("rows new each batch (1000-9000)", [draw.randint(1000, 9000) for _ in range(200)], 1),
             ("rows new, rounded up to 64", [draw.randint(300, 900) for _ in range(200)], 64)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host us per F.linear")
    for name, rows, align in cases:
        print(f"  {name:34} {host_us_per_call(weights, x, rows, align):6.1f}")


if __name__ == "__main__":
    main()
