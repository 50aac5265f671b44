"""The communicator (chapter 16): all-reduce, all-gather and broadcast over torch.distributed, gloo
on CPU and NCCL on CUDA; the model code never names a backend."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .info import DistributedInfo, set_tp_info

# The group's two halves: device tensors go over the main group (NCCL on CUDA, gloo on the CPU),
# host tensors (the scheduler's message count, free memory) over gloo. None: no group joined.
_DEVICE_GROUP: dist.ProcessGroup | None = None
_HOST_GROUP: dist.ProcessGroup | None = None


def init_distributed(info: DistributedInfo, device: torch.device, init_method: str,
                     timeout_s: float = 60.0) -> None:
    """Join the tensor-parallel group. `init_method` is a rendezvous every rank can reach, e.g.
    tcp://127.0.0.1:PORT or file://PATH. One rank joins nothing unless given a rendezvous (a
    group of one still runs every collective through the backend: the GPU check does that)."""
    global _DEVICE_GROUP, _HOST_GROUP
    set_tp_info(info)
    if _DEVICE_GROUP is not None or (info.size == 1 and not init_method):
        return
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method,
                            rank=info.rank, world_size=info.size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if cuda else None)
    _DEVICE_GROUP = dist.group.WORLD
    _HOST_GROUP = dist.new_group(backend="gloo") if cuda else _DEVICE_GROUP


def destroy_distributed() -> None:
    global _DEVICE_GROUP, _HOST_GROUP
    if _DEVICE_GROUP is not None:
        dist.destroy_process_group()
    _DEVICE_GROUP = _HOST_GROUP = None


def _group(x: torch.Tensor) -> dist.ProcessGroup | None:
    return _HOST_GROUP if x.device.type == "cpu" else _DEVICE_GROUP


def all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
               ) -> torch.Tensor:
    """The reduction over ranks (default: the sum, a row-parallel layer's partial outputs), in
    place."""
    if (group := _group(x)) is not None:
        dist.all_reduce(x, op, group=group)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x, stacked along a new first dimension: [size, *x.shape]."""
    if (group := _group(x)) is None:
        return x.unsqueeze(0)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.stack(out)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank src's x on every rank, in place."""
    if (group := _group(x)) is not None:
        dist.broadcast(x, src, group=group)
    return x
