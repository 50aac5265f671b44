"""Tensor parallelism's plumbing: ranks and collectives (chapter 16)."""

from .comm import all_gather, all_reduce, broadcast, destroy_distributed, init_distributed
from .info import DistributedInfo, get_tp_info, set_tp_info

__all__ = ["DistributedInfo", "all_gather", "all_reduce", "broadcast", "destroy_distributed",
           "get_tp_info", "init_distributed", "set_tp_info"]
