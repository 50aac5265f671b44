"""Device abstraction (chapter 6): CUDA streams, events and pinned memory, no-ops on the CPU;
stream contexts for the overlap loop."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch


class NullEvent:
    """Stands in for torch.cuda.Event on the CPU, where every copy is already finished."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class NullStream:
    """Stands in for torch.cuda.Stream on the CPU: work runs in program order anyway."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


def pick_device(requested: str | None = None, rank: int = 0) -> torch.device:
    """CUDA when present, else the CPU; never MPS (its float32 is not exact enough to match HF).
    A CUDA device without an index is the rank's GPU: cuda:rank."""
    if requested:
        device = torch.device(requested)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank)  # an explicit index: torch.cuda.set_device needs one
    return device


def create_stream(device: torch.device) -> torch.cuda.Stream | NullStream:
    return torch.cuda.Stream(device) if device.type == "cuda" else NullStream()


def create_event(device: torch.device) -> torch.cuda.Event | NullEvent:
    return torch.cuda.Event() if device.type == "cuda" else NullEvent()


def pin_memory(device: torch.device) -> bool:
    """Whether host buffers that feed `device` should be page-locked (only for CUDA)."""
    return device.type == "cuda"


def to_device(values: list[int] | list[float], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for it: staged in pinned memory and copied
    asynchronously on the current stream. torch.tensor(values, device=...) or a plain .to()
    copies from pageable memory, and such a copy synchronizes the stream: the host would wait
    for everything queued before it."""
    host = torch.tensor(values, dtype=dtype, pin_memory=pin_memory(device))
    return host.to(device, non_blocking=True)


def physical_cores() -> int:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; os.cpu_count() elsewhere."""
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


def set_cpu_threads(tp_size: int = 1) -> int:
    """physical cores / TP torch threads, unless OMP_NUM_THREADS says otherwise."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = max(1, physical_cores() // tp_size)
    torch.set_num_threads(threads)
    return threads


def set_host_threads() -> int:
    """One torch thread beside a GPU, unless OMP_NUM_THREADS says otherwise. The host only keeps
    the books of each step there; a pool of threads would make each parallel operation wait at
    a barrier for cores that the server's other processes and its clients hold."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    return torch.get_num_threads()


def stream_context(stream: torch.cuda.Stream | NullStream) -> AbstractContextManager[object]:
    """`with stream_context(s):` makes s the current CUDA stream; does nothing on the CPU."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else nullcontext()


def set_current_stream(stream: torch.cuda.Stream | NullStream) -> None:
    if isinstance(stream, torch.cuda.Stream):
        torch.cuda.set_stream(stream)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
