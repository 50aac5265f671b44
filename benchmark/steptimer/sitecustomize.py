"""The same step timer in any minisgl package, ours or the official's (benchmark/online.py
--step-timer puts this folder first on PYTHONPATH and names a file in MINISGL_STEP_TIMER).

Python imports `sitecustomize` at start in every process; this one waits for
`minisgl.scheduler.scheduler` to be imported and wraps three methods that both packages'
overlap loops call once per step, in this order: `_schedule_next_batch` (pick and prepare the
next batch), `_forward` (launch it) and `_process_last_data` (wait for the previous batch's
tokens and hand them out). Each step becomes one JSON line in chapter 21's StepTrace shape:
`t` (perf_counter when the previous step ended), the milliseconds of receive (from then),
prepare, launch, wait (0: counted in reply) and reply, and the phase, size and new tokens of
the batch launched; `early` where the previous batch's tokens were handed out before this
batch's launch (ours, when they are ready and a prefill is on either side): when they left,
in milliseconds after `t` (that time counts in reply);
a prefill row also carries `cuda`, the caching allocator's counts after its launch. A
diagnostic: the wrappers cost about a microsecond per call, and writing a step's row a few
more (it falls in the next step's receive)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time
from typing import TextIO

TARGET = "minisgl.scheduler.scheduler"
PATH = os.environ.get("MINISGL_STEP_TIMER", "")


class _Timer:
    """Each step's row is written as the step ends, to PATH.PID of the process that ran it: a
    forked child (ours's scheduler: the launcher imports the module and is patched here) writes
    its own file, and a process killed at shutdown (a child's exit skips atexit) loses nothing.
    The write costs a few microseconds per step, alike on both sides."""

    def __init__(self, path: str) -> None:
        self.path, self.row = path, None
        self.file: TextIO | None = None
        self.pid = 0  # the process self.file belongs to
        self.early: tuple[float, float] | None = None  # a hand-out before scheduling
        self.early_ms = 0.0  # this step's early hand-out, added to its reply
        self.launching = False  # this step's batch was launched
        self.last_end = time.perf_counter()

    def write(self, row: dict) -> None:
        if self.pid != os.getpid():  # first row of this process (a fork copies self.file)
            self.pid = os.getpid()
            self.file = open(f"{self.path}.{self.pid}", "a", buffering=1)  # a line at a time
        assert self.file is not None
        self.file.write(json.dumps(row) + "\n")

    def patch(self, cls: type) -> None:
        schedule, forward, process = (cls._schedule_next_batch, cls._forward,
                                      cls._process_last_data)
        timer = self

        def _schedule_next_batch(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = schedule(self, *args, **kwargs)
            t1 = time.perf_counter()
            began, early = timer.last_end, timer.early
            timer.row = {"t": round(began, 6), "receive": round(1e3 * (t0 - began), 4),
                         "prepare": round(1e3 * (t1 - t0), 4), "launch": 0.0, "wait": 0.0}
            if early:  # handed out between receive and this: reply, not receive
                timer.row["receive"] = round(1e3 * (early[0] - began), 4)
                timer.row["early"] = round(1e3 * (early[1] - began), 4)
                timer.early_ms = 1e3 * (early[1] - early[0])
                timer.early = None
            if out is not None:
                batch = out.batch
                timer.row.update(phase="prefill" if batch.is_prefill else "decode",
                                 size=len(batch.reqs),
                                 tokens=sum(r.extend_len for r in batch.reqs))
            timer.mark = t1
            return out

        def _forward(self, *args, **kwargs):
            timer.launching = True
            out = forward(self, *args, **kwargs)
            if timer.row is not None:
                t = time.perf_counter()
                timer.row["launch"] = round(1e3 * (t - timer.mark), 4)
                if timer.row.get("phase") == "prefill":  # after it, outside the timed part:
                    timer.row["cuda"] = _allocator_counts()  # cudaMalloc/Free so far
                timer.mark = time.perf_counter()
            return out

        def _process_last_data(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = process(self, *args, **kwargs)
            t = time.perf_counter()
            # ours hands a batch's tokens out early where they are ready and a prefill is on
            # either side: before the next batch is scheduled, or before a prefill's launch
            if timer.row is None:
                timer.early = (t0, t)
                return out
            if not timer.launching and timer.row.get("phase") == "prefill":
                timer.row["early"] = round(1e3 * (t - timer.row["t"]), 4)
                timer.early_ms += 1e3 * (t - t0)
                timer.mark = t  # the launch is timed from here
                return out
            # everything from the launch's end: ours's bookkeeping after launch included, and
            # an early hand-out if there was one
            timer.row["reply"] = round(1e3 * (t - timer.mark) + timer.early_ms, 4)
            timer.write(timer.row)
            timer.row, timer.launching, timer.early_ms = None, False, 0.0
            timer.last_end = t
            return out

        cls._schedule_next_batch = _schedule_next_batch
        cls._forward = _forward
        cls._process_last_data = _process_last_data


def _allocator_counts() -> list[int]:
    """torch's caching allocator on this process's GPU: [retries after a failed allocation,
    cudaMalloc calls, cudaFree calls], cumulative. Each of these waits for the device, so
    one inside a launch stalls it (read after prefill launches only: it costs ~0.1 ms)."""
    import torch

    if not torch.cuda.is_available():
        return [0, 0, 0]
    stats = torch.cuda.memory_stats()
    return [int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc",
                                           "num_device_free")]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _Timer(PATH).patch(module.Scheduler)

        spec.loader.exec_module = exec_module
        return spec


if PATH:
    sys.meta_path.insert(0, _Finder())
