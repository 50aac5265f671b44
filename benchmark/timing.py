"""The timers the GPU benchmarks share (issue "14 ·"): GPU time per call from CUDA events, host
time per call from the clock, both as the median and range of K repeats of N back-to-back calls;
GPU time per call with no host work (a CUDA graph replayed); the wall time of one synchronized
call; and the mean decode step of a generate.

A GPU call returns before its kernels finish: CUDA events time the GPU (the kernels, plus every
gap where the host was late with the next launch), the host clock times the launches. Which one
a figure is decides what it means, so each function says which it uses. Every time is in
milliseconds (a step, a call) or seconds (a whole run), as the name says.

    from timing import cuda_ms
    median, low, high = cuda_ms(fn, calls=200, repeats=5, warmup=10)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch


class Span(NamedTuple):
    """The median and the range of repeated measurements, in the unit they were taken in."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Span:
        return cls(statistics.median(values), min(values), max(values))

    def scaled(self, factor: float) -> Span:
        """The same span in another unit: `span.scaled(1e3)` turns ms into us."""
        return Span(self.median * factor, self.low * factor, self.high * factor)


def cuda_ms(fn: Callable[[], object], calls: int = 1, repeats: int = 5,
            warmup: int = 0) -> Span:
    """GPU milliseconds per call: `warmup` untimed calls and a synchronize, then `repeats` times
    CUDA events around `calls` back-to-back calls, the GPU drained after each repeat. With few
    calls of a short kernel the figure is the host's launch cost: the GPU waits for it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return Span.of(times)


def host_ms(fn: Callable[[], object], calls: int = 1, repeats: int = 5, warmup: int = 0,
            sync: bool = False) -> Span:
    """Host milliseconds per call (perf_counter): `warmup` untimed calls, then `repeats` times
    `calls` back-to-back calls. With `sync` the GPU is drained before each repeat, not inside
    one, so that no call waits for a full launch queue; without it no CUDA call is made (a CPU
    machine)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return Span.of(times)


def graph_ms(fn: Callable[[], object], calls: int = 50) -> float:
    """GPU milliseconds per call with no host work in between: `calls` calls captured in one
    CUDA graph, replayed once untimed, then once between CUDA events."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return cuda_ms(graph.replay, repeats=1).median / calls


def wall_s(fn: Callable[[], object]) -> float:
    """Seconds of one call on the host clock, the GPU synchronized before and after it, so that
    the call's kernels count and no earlier call's do."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ms_per_step(run: Callable[[int], object], steps: int) -> float:
    """The mean decode step (ms) of run(k), which generates k tokens: the time of steps + 1
    tokens less the time of 1 (the prefill, which gives the first token), over steps."""
    one, many = wall_s(lambda: run(1)), wall_s(lambda: run(steps + 1))
    return (many - one) / steps * 1e3
