"""StepTrace (chapter 21): where each step of the scheduler's loop spends its time, for profiling
a server under load. Off unless MINISGL_STEP_TRACE names a file; then every step appends one
row in memory (at most MAX_ROWS) and the rows are written there as JSON lines at shutdown.
LaunchProfile: the operators inside the prefill launches, under MINISGL_LAUNCH_PROFILE."""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import time
from collections.abc import Iterator

import torch

from minisgl.core import Batch

MAX_ROWS = 1_000_000  # ~100 MB of rows at most, whatever the run's length


class StepTrace:
    """One row per loop iteration: when it began (time.perf_counter(), the monotonic clock), the
    milliseconds spent receiving requests, scheduling and preparing the next batch, launching
    it, waiting for the previous batch's tokens, and handing them out; the phase and size of
    the batch launched (none when the step only finished the previous one). Where the previous
    batch's tokens were handed out before this one's launch (Scheduler._hand_out_if_ready),
    that time counts as reply, and `early` says when they left: milliseconds after `t`."""

    PARTS = ("receive", "prepare", "launch", "wait", "reply")

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[dict[str, object]] = []
        self.marks: list[float] = []
        self.batch: dict[str, object] = {}
        self.early: list[tuple[str, float, float]] = []  # (the part it fell in, began, ended)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("MINISGL_STEP_TRACE")
        return cls(path) if path else None

    def begin(self) -> None:
        self.marks, self.batch, self.early = [time.perf_counter()], {}, []

    def handed_out_early(self, began: float, ended: float) -> None:
        """The previous batch's tokens were handed out inside a later part (prepare or
        launch): that time is moved to reply."""
        self.early.append((self.PARTS[len(self.marks) - 1], began, ended))

    def mark(self) -> None:
        """The end of the next part, in PARTS order."""
        self.marks.append(time.perf_counter())

    def launched(self, batch: Batch) -> None:
        """The batch this step launches, as it was scheduled."""
        self.batch = {"phase": batch.phase, "size": batch.size,
                      "tokens": sum(r.extend_len for r in batch.reqs)}

    def end(self) -> None:
        m = self.marks
        if len(m) != len(self.PARTS) + 1 or len(self.rows) >= MAX_ROWS:
            return
        row: dict[str, object] = {"t": round(m[0], 6)}  # monotonic: other processes can match
        ms = {p: 1e3 * (b - a) for p, a, b in zip(self.PARTS, m, m[1:])}
        for part, began, ended in self.early:
            ms[part] -= 1e3 * (ended - began)
            ms["reply"] += 1e3 * (ended - began)
            row["early"] = round(1e3 * (ended - m[0]), 4)  # when they left, from `t`
        row.update({p: round(v, 4) for p, v in ms.items()})
        row.update(self.batch)
        self.rows.append(row)

    def write(self) -> None:
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.rows)


class LaunchProfile:
    """Where the host's time goes while a prefill batch is launched, under real load: off
    unless MINISGL_LAUNCH_PROFILE names a file (FILE or FILE:N). Then torch.profiler runs from
    the first prefill launch until N of them (50 by default) were recorded, each inside a
    `minisgl::prefill_launch` range, and the file gets one JSON object: the launches, their
    total milliseconds, and the operators that ran inside them ranked by host (self) time.
    A diagnostic: the profiler slows every step while it runs."""

    RANGE = "minisgl::prefill_launch"

    def __init__(self, path: str, launches: int = 50) -> None:
        self.path, self.wanted = path, launches
        self.seen = 0
        self.profiler: torch.profiler.profile | None = None
        self.done = False

    @classmethod
    def from_env(cls) -> LaunchProfile | None:
        value = os.environ.get("MINISGL_LAUNCH_PROFILE")
        if not value:
            return None
        path, _, count = value.partition(":")
        return cls(path, int(count) if count else 50)

    @contextlib.contextmanager
    def launch(self, batch: Batch) -> Iterator[None]:
        if self.done or not batch.is_prefill:
            yield
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        with torch.profiler.record_function(self.RANGE):
            yield
        self.seen += 1
        if self.seen >= self.wanted:
            self.write()

    def write(self) -> None:
        """Stop and write what was recorded (at N launches, or at shutdown with fewer)."""
        if self.done or self.profiler is None:
            return
        self.profiler.stop()
        self.done = True
        events = self.profiler.events()
        # the range's host event only: with CUDA activity the profiler also keeps its device
        # side under the same name (seen on the H200: 120 spans for 40 launches)
        spans = sorted((e.time_range.start, e.time_range.end) for e in events
                       if e.name == self.RANGE and e.device_type == torch.autograd.DeviceType.CPU)
        starts = [s for s, _ in spans]
        ops: dict[str, list[float]] = {}
        for e in events:
            i = bisect.bisect_right(starts, e.time_range.start) - 1
            if e.name == self.RANGE or i < 0 or e.time_range.start >= spans[i][1]:
                continue  # outside every prefill launch
            total = ops.setdefault(e.name, [0.0, 0])
            total[0] += e.self_cpu_time_total / 1e3
            total[1] += 1
        ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])[:40]
        with open(self.path, "w") as f:
            json.dump({"launches": len(spans),
                       "launch_ms": round(sum(b - a for a, b in spans) / 1e3, 3),
                       "ops": [[name, round(ms, 3), int(n)] for name, (ms, n) in ranked]}, f)
