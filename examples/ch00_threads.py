"""第 0 章示例：CPU 线程数对 decode 速度的影响（朴素引擎，SmolLM2-135M-Instruct，float32）。

    python examples/ch00_threads.py            # 1、物理核数、4 倍和 16 倍物理核数（超额订阅）个线程
    python examples/ch00_threads.py --quick    # 冒烟测试：同样的代码，预热 1 步、计时 2 步

每种线程数先预热，再取 20 次 decode 的中位数；同一次运行里并排测量。
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "chapters" / "ch00_naive"))

import torch  # noqa: E402

from naive import NaiveEngine  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


# The same as minisgl.utils.device.physical_cores (chapter 6), kept as a copy on purpose: this
# example belongs to chapter 0, which runs on naive.py alone, before the minisgl package exists.
def physical_cores() -> int:
    """Distinct (physical id, core id) pairs of /proc/cpuinfo; os.cpu_count() if unreadable."""
    try:
        pairs, phys = set(), "0"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                phys = value.strip()
            elif key.strip() == "core id":
                pairs.add((phys, value.strip()))
        return len(pairs) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def decode_ms(engine: NaiveEngine, threads: int, steps: int, warmup: int) -> float:
    """Median time of one decode step (one new token after a 32-token context)."""
    torch.set_num_threads(threads)
    engine.reset()
    engine.forward(list(range(100, 132)))
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        engine.forward([200 + i])
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description="decode speed against torch thread count")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 warm-up, 2 steps")
    args = parser.parse_args()
    if args.quick:  # what `tools/steps.py check` runs: the same code, in seconds
        args.steps, args.warmup = 2, 1
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    cores = physical_cores()
    print(f"machine: {platform.machine()}, {os.cpu_count()} logical CPUs, {cores} physical cores; "
          f"torch {torch.__version__}; date {datetime.date.today()}")
    print(f"torch default threads: {torch.get_num_threads()}")
    engine = NaiveEngine(MODEL)
    results = {}
    for threads in sorted({1, cores, 4 * cores, 16 * cores}):
        results[threads] = decode_ms(engine, threads, args.steps, args.warmup)
    best = min(results.values())
    print(f"decode step, median of {args.steps} warm steps:")
    for threads, ms in results.items():
        print(f"  {threads} threads: {ms:.1f} ms ({ms / best:.2f}x the fastest)")

if __name__ == "__main__":
    main()
