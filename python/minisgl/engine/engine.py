"""The Engine: model, KV pool, page table, backend and sampler; runs one batch (chapter 6)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist

from minisgl import kernel
from minisgl.attention import create_attention_backend, resolve_backend_name
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.distributed import all_reduce, destroy_distributed, init_distributed
from minisgl.distributed.shard import local_config, shard_of
from minisgl.kvcache import create_kvcache_pool
from minisgl.models import create_model, load_weight
from minisgl.moe import BaseMoeBackend, create_moe_backend, resolve_moe_backend
from minisgl.utils.device import (
    NullEvent,
    create_event,
    create_stream,
    pick_device,
    set_cpu_threads,
    set_host_threads,
)

from .config import EngineConfig
from .graph import GraphRunner, graph_batch_sizes
from .sample import BatchSamplingArgs, Sampler

logger = logging.getLogger(__name__)


class ForwardOutput(NamedTuple):
    next_tokens_device: torch.Tensor  # [bs] int32, stays on the device (next step's input)
    next_tokens_cpu: torch.Tensor  # [bs] int32, valid once copy_done has fired
    copy_done: torch.cuda.Event | NullEvent  # a NullEvent on the CPU


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp = config.tp_info
        self.device = pick_device(config.device, tp.rank)  # rank r: cuda:r
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.num_threads = (set_cpu_threads(tp.size) if self.device.type == "cpu"
                            else set_host_threads())
        init_distributed(tp, self.device, config.dist_init)  # no group needed for one rank
        self.stream = create_stream(self.device)
        if self.device.type == "cuda":
            torch.cuda.set_stream(self.stream)  # type: ignore[arg-type]
        self.dtype = config.dtype
        self.ctx = Context(config.page_size)
        set_global_ctx(self.ctx)
        try:
            self._build(config)
        except BaseException:
            set_global_ctx(None)  # a failed engine must not block the next one
            raise

    def _build(self, config: EngineConfig) -> None:
        tp = config.tp_info
        # this rank's heads and MLP share: the model, the KV pool and attention are sized by it
        self.local_config = model_config = local_config(config.model_config, tp)
        free_before = self._free_memory()
        agree_free_memory(free_before)  # refuses ranks too far apart before any work
        backend = resolve_backend_name(config.attention_backend, self.device, self.dtype,
                                       head_dim=model_config.head_dim)
        logger.info("kernels: %s", kernel.describe(self.device))
        self.moe_backend: BaseMoeBackend | None = None
        if model_config.num_experts:  # before the weights: a missing Triton is said at once
            moe_name = resolve_moe_backend(config.moe_backend, self.device)
            self.ctx.moe_backend = self.moe_backend = create_moe_backend(moe_name, self.device)
            logger.info("MoE: %d experts, top %d, the %s backend", model_config.num_experts,
                        model_config.num_experts_per_tok, moe_name)

        # the model is built on the meta device (no memory), then the weights replace its tensors
        with torch.device("meta"), _default_dtype(self.dtype):
            self.model = create_model(model_config)
        self.model.load_state_dict(load_weight(
            config.model_path, self.device, self.dtype,
            tie_word_embeddings=model_config.tie_word_embeddings,
            shards=lambda name: shard_of(name, config.model_config, tp)))  # only this rank's slice

        self.num_pages = self._determine_num_pages(free_before)
        num_tokens = self.num_pages * config.page_size
        self.ctx.kv_cache = self.kv_cache = create_kvcache_pool(
            model_config, num_pages=self.num_pages + 1, page_size=config.page_size,
            device=self.device, dtype=self.dtype)
        self.max_seq_len = min(config.max_seq_len, num_tokens)
        # one row per running request + one for the dummy request; entries are token slots
        self.ctx.page_table = self.page_table = torch.zeros(
            (config.max_running_req + 1, _align_up(self.max_seq_len, 32)), dtype=torch.int32,
            device=self.device)
        self.ctx.attn_backend = self.attn_backend = create_attention_backend(backend,
                                                                             model_config)
        self.sampler = Sampler(self.device, model_config.vocab_size, config.seed)
        # pads batches to a captured size; its row points at the extra page
        self.dummy_req = Req(torch.tensor([0], dtype=torch.int32), table_idx=config.max_running_req,
                             cached_len=0, output_len=1, uid=-1, sampling_params=SamplingParams())
        self.page_table[self.dummy_req.table_idx].fill_(num_tokens)
        self.graph_runner = GraphRunner(
            self.model, self.ctx, self.stream, sizes=self._graph_sizes(),
            vocab_size=config.model_config.vocab_size, dtype=self.dtype,
            dummy_req=self.dummy_req, dummy_slot=num_tokens)

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture. Default: up to 256 on a GPU; none on the
        CPU, where an emulated graph checks the contract but saves nothing."""
        c = self.config
        max_bs = c.cuda_graph_max_bs
        if max_bs is None:
            max_bs = 256 if self.device.type == "cuda" else 0
        if max_bs > 0 and not self.attn_backend.supports_graphs:
            logger.warning("graphs off: the %s backend cannot be captured",
                           c.attention_backend)
            return []
        if max_bs > 0 and self.moe_backend is not None and not self.moe_backend.supports_graphs:
            logger.warning("graphs off: the %s cannot be captured (it reads counts on the host)",
                           type(self.moe_backend).__name__)
            return []
        return graph_batch_sizes(max_bs, c.max_running_req)

    def _free_memory(self) -> int:
        """Free device memory; on the CPU, the KV budget (the ranks share one memory)."""
        if self.device.type != "cuda":
            return self.config.cpu_kv_cache_bytes
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def _determine_num_pages(self, free_before: int) -> int:
        c, mc = self.config, self.local_config
        page_bytes = (2 * mc.num_layers * c.page_size * mc.num_kv_heads * mc.head_dim
                      * self.dtype.itemsize)
        if c.num_page_override is not None:
            num_pages = c.num_page_override
        elif self.device.type == "cuda":  # what is left of memory_ratio after the weights
            model_bytes = free_before - self._free_memory()
            num_pages = (int(c.memory_ratio * free_before) - model_bytes) // page_bytes
        else:
            num_pages = free_before // page_bytes
        # every rank must hold the same pool (the schedulers run in lockstep): the smallest
        num_pages = int(all_reduce(torch.tensor([num_pages]), dist.ReduceOp.MIN))
        if num_pages < 2:
            raise RuntimeError(f"room for only {num_pages} KV pages of {page_bytes} bytes: "
                               "raise cpu_kv_cache_bytes / memory_ratio or num_page_override")
        return num_pages

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        """One forward pass and one sampled token per request: a graph replay for a decode
        batch padded to a captured size, else the model run eagerly."""
        if self.graph_runner.can_use(batch):
            logits = self.graph_runner.replay(batch)
        else:
            with self.ctx.forward_batch(batch):
                logits = self.model.forward()
        for req in batch.reqs:
            req.complete_one()
        next_tokens = self.sampler.sample(logits[: batch.size], args).to(torch.int32)
        next_tokens_cpu = next_tokens.to("cpu", non_blocking=True)
        copy_done = create_event(self.device)
        copy_done.record(self.stream)  # type: ignore[arg-type]  # a CUDA stream with a CUDA event
        return ForwardOutput(next_tokens, next_tokens_cpu, copy_done)

    def shutdown(self) -> None:
        self.graph_runner.destroy()  # before the groups its graphs captured are destroyed
        set_global_ctx(None)
        destroy_distributed()


def agree_free_memory(free: int, tolerance: int = 2 << 30) -> int:
    """The least free memory of any rank, so every rank sizes the same KV pool and it fits on
    the tightest. One all-reduce (MIN of [free, -free]) gives the least and the most; ranks
    further apart than `tolerance` mean another process holds one GPU: refused."""
    x = all_reduce(torch.tensor([free, -free], dtype=torch.int64), dist.ReduceOp.MIN)
    least, most = int(x[0]), -int(x[1])
    if most - least > tolerance:
        raise RuntimeError(f"free memory differs across tensor-parallel ranks: {least / 2**30:.2f}"
                           f" to {most / 2**30:.2f} GiB, more than {tolerance / 2**30:.0f} GiB "
                           "apart; another process is using one of the GPUs (see nvidia-smi)")
    return least


def _align_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
