"""The communicator: all-reduce, all-gather and broadcast over torch.distributed, gloo on CPU and
NCCL on CUDA; the model code never names a backend (chapter 16)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .info import DistributedInfo, get_tp_info, set_tp_info


def init_distributed(info: DistributedInfo, device: torch.device, init_method: str,
                     timeout_s: float = 60.0) -> None:
    """Join the tensor-parallel group (nothing to join for one rank). `init_method` is a
    rendezvous every rank can reach, e.g. tcp://127.0.0.1:PORT or file://PATH."""
    set_tp_info(info)
    if info.size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=info.rank,
                            world_size=info.size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks, in place (a row-parallel layer's partial outputs)."""
    if get_tp_info().size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x, stacked along a new first dimension: [size, *x.shape]."""
    size = get_tp_info().size
    if size == 1:
        return x.unsqueeze(0)
    flat = x.contiguous().view(-1)  # gloo gathers into one flat tensor, rank after rank
    out = torch.empty(size * flat.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, flat)
    return out.view(size, *x.shape)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank src's x on every rank, in place."""
    if get_tp_info().size > 1:
        dist.broadcast(x, src)
    return x
