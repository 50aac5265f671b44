"""StepTrace: where each step of the scheduler's loop spends its time, for profiling a server
under load (chapter 21). Off unless MINISGL_STEP_TRACE names a file; then every step appends one
row in memory (at most MAX_ROWS) and the rows are written there as JSON lines at shutdown."""

from __future__ import annotations

import json
import os
import time

from minisgl.core import Batch

MAX_ROWS = 1_000_000  # ~100 MB of rows at most, whatever the run's length


class StepTrace:
    """One row per loop iteration: when it began (time.perf_counter(), the monotonic clock), the
    milliseconds spent receiving requests, scheduling and preparing the next batch, launching
    it, waiting for the previous batch's tokens, and handing them out; the phase and size of
    the batch launched (none when the step only finished the previous one)."""

    PARTS = ("receive", "prepare", "launch", "wait", "reply")

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[dict[str, object]] = []
        self.marks: list[float] = []
        self.batch: dict[str, object] = {}

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("MINISGL_STEP_TRACE")
        return cls(path) if path else None

    def begin(self) -> None:
        self.marks, self.batch = [time.perf_counter()], {}

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
        row.update({p: round(1e3 * (b - a), 4) for p, a, b in zip(self.PARTS, m, m[1:])})
        row.update(self.batch)
        self.rows.append(row)

    def write(self) -> None:
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
