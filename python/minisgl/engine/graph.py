"""GraphRunner (chapter 18): decode batches replayed from captured CUDA graphs, and EmulatedGraph,
the same contract on the CPU."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from minisgl.attention import BaseAttnBackend
from minisgl.core import Batch, Context, Req
from minisgl.models import BaseLLMModel

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int, max_running_req: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_bs and never past max_running_req (a batch
    cannot be larger); the top size itself is always captured. 0 or less: no graphs."""
    top = min(max_bs, max_running_req)
    if top < 1:
        return []
    return sorted({s for s in (1, 2, 4) if s < top} | set(range(8, top, 8)) | {top})


class _NoHostReads(TorchDispatchMode):
    """Refuses what CUDA stream capture refuses: reading a tensor's value on the host (.item(),
    int(t), nonzero), which would freeze one batch's value into every replay."""

    REFUSED = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in self.REFUSED:
            raise RuntimeError(f"graph capture: {func} reads a tensor's value on the host; a "
                               "captured step must keep every value on the device")
        return func(*args, **(kwargs or {}))


class EmulatedGraph:
    """A CUDA graph's contract on the CPU. Capture records the step; replay runs it again on the
    same batch object, so it reads only what the captured buffers hold now: an input the runner
    forgot to copy in is stale, and the answer is wrong, as on a GPU. Host reads of tensor
    values are refused, as stream capture refuses them."""

    def __init__(self) -> None:
        self.step: Callable[[], None] | None = None

    def capture(self, step: Callable[[], None], pool: Any = None) -> None:
        with _NoHostReads():
            step()
        self.step = step

    def replay(self) -> None:
        assert self.step is not None, "replay before capture"
        with _NoHostReads():
            self.step()

    def pool(self) -> Any:
        return None


class CudaGraph:
    """torch.cuda.CUDAGraph behind the same three methods, captured on the engine's stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.graph, self.stream = torch.cuda.CUDAGraph(), stream

    def capture(self, step: Callable[[], None], pool: Any = None) -> None:
        with torch.cuda.graph(self.graph, pool=pool, stream=self.stream):
            step()

    def replay(self) -> None:
        self.graph.replay()

    def pool(self) -> Any:
        return self.graph.pool()


class GraphRunner:
    """Captures one graph per batch size, largest first, all in one memory pool, and replays
    decode batches: the batch is padded with dummy requests to the next captured size, its
    inputs are copied into the static buffers the graph reads, and the graph runs."""

    INPUTS = ("input_ids", "positions", "out_loc")  # what replay copies into static buffers

    def __init__(self, model: BaseLLMModel, ctx: Context, stream: Any, sizes: list[int],
                 vocab_size: int, dtype: torch.dtype, dummy_req: Req, dummy_slot: int) -> None:
        self.model, self.ctx, self.stream, self.sizes = model, ctx, stream, sizes
        self.max_bs = max(sizes, default=0)
        self.dummy_req = dummy_req
        self.graphs: dict[int, EmulatedGraph | CudaGraph] = {}
        if not sizes:
            return
        device = ctx.page_table.device
        # the static inputs and output every graph reads and writes: views [:bs] of these
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        # capture writes its K/V into the dummy page, never a slot a request may own
        self.out_loc = torch.full((self.max_bs,), dummy_slot, dtype=torch.int32, device=device)
        self.logits = torch.empty(self.max_bs, vocab_size, dtype=dtype, device=device)
        self._capture_all(ctx.attn_backend, device)

    @torch.inference_mode()
    def _capture_all(self, backend: BaseAttnBackend, device: torch.device) -> None:
        backend.init_capture_graph(self.ctx.page_table.shape[1], self.sizes)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            free_before = torch.cuda.mem_get_info(device)[0]
        start, pool = time.perf_counter(), None
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing graphs", unit="graph"):
            batch = Batch([self.dummy_req] * bs, "decode")
            batch.padded_reqs = batch.reqs
            batch.input_ids, batch.positions = self.input_ids[:bs], self.positions[:bs]
            batch.out_loc = self.out_loc[:bs]
            backend.prepare_for_capture(batch)
            graph = CudaGraph(self.stream) if cuda else EmulatedGraph()
            step = self._step(batch)
            step()  # warm-up: lazy initialisations and kernel choices happen outside capture
            graph.capture(step, pool)
            pool = pool if pool is not None else graph.pool()  # the largest graph's pool
            self.graphs[bs] = graph
        took = time.perf_counter() - start
        if cuda:
            torch.cuda.synchronize(device)
            used = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20
            logger.info("captured %d graphs (batch sizes %s) in %.1f s, %.0f MiB of GPU memory",
                        len(self.sizes), self.sizes, took, used)
        else:
            logger.info("emulated %d graphs (batch sizes %s) in %.1f s", len(self.sizes),
                        self.sizes, took)

    def _step(self, batch: Batch) -> Callable[[], None]:
        def step() -> None:
            with self.ctx.forward_batch(batch):
                self.logits[: batch.size].copy_(self.model.forward())
        return step

    def can_use(self, batch: Batch) -> bool:
        """A decode batch padded to a captured size; prefill, and larger batches, run eagerly."""
        return batch.is_decode and batch.padded_size in self.graphs

    def pad(self, batch: Batch) -> None:
        """padded_reqs: the batch, plus dummy requests up to the next captured size."""
        if not (batch.is_decode and batch.size <= self.max_bs):
            batch.padded_reqs = batch.reqs
            return
        size = next(s for s in self.sizes if s >= batch.size)
        batch.padded_reqs = batch.reqs + [self.dummy_req] * (size - batch.size)

    @torch.inference_mode()
    def replay(self, batch: Batch) -> torch.Tensor:
        """The padded batch's inputs into the static buffers, the backend's too, then the
        graph. Returns the real rows of the static logits: read them before the next replay."""
        bs = batch.padded_size
        for name in self.INPUTS:
            getattr(self, name)[:bs].copy_(getattr(batch, name))
        self.ctx.attn_backend.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.logits[: batch.size]

    def destroy(self) -> None:
        """Graphs go before the NCCL groups they captured are torn down."""
        self.graphs.clear()
