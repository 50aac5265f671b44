"""EngineConfig: what an Engine needs to know, including where it runs (chapter 6)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from minisgl.distributed import DistributedInfo
from minisgl.model_config import ModelConfig, load_hf_config


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: torch.dtype = torch.float32
    max_running_req: int = 256
    attention_backend: str = "auto"
    page_size: int = 1
    memory_ratio: float = 0.9  # GPU: share of free memory for weights + KV cache
    max_seq_len_override: int | None = None
    num_page_override: int | None = None
    device: str | None = None  # None: CUDA if present, else CPU
    cpu_kv_cache_bytes: int = 1 << 30  # CPU: how much memory the KV pool may take
    seed: int = 42
    tp_info: DistributedInfo = DistributedInfo()  # this rank of the tensor-parallel group
    dist_init: str = ""  # where the ranks meet (tcp://HOST:PORT or file://PATH)
    cuda_graph_max_bs: int | None = None  # None: 256 on a GPU, 0 (no graphs) on the CPU
    moe_backend: str = "auto"  # an MoE model's experts: torch, triton; auto picks

    @cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(load_hf_config(self.model_path))

    @property
    def max_seq_len(self) -> int:
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return self.model_config.max_position
