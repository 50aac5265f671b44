"""The Scheduler: admits requests, builds batches, runs them, hands out tokens (chapter 7;
admission in 8, prefix caching in 9)."""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple, NoReturn

import torch
from transformers import AutoTokenizer

from minisgl.core import Batch
from minisgl.engine import BatchSamplingArgs, Engine, ForwardOutput
from minisgl.utils.device import pin_memory

from .cache import CacheManager, table_cells
from .config import SchedulerConfig
from .decode import DecodeManager
from .prefill import PrefillManager
from .table import TableManager
from .utils import PendingReq, SchedulerStats, TokenReply

logger = logging.getLogger(__name__)
Indices2D = tuple[torch.Tensor, torch.Tensor]  # (rows, columns) of the page table / token pool


class ForwardInput(NamedTuple):
    """A prepared batch, with the 2D indices of its input tokens and of its sampled tokens."""

    batch: Batch
    sample_args: BatchSamplingArgs
    load_indices: Indices2D  # where its input tokens are: (row, position) per token
    write_indices: Indices2D  # where its sampled tokens go: (row, device_len) per request


ForwardData = tuple[ForwardInput, ForwardOutput]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.device = self.engine.device
        # the most prompt + output tokens a request may have: the engine's limit, and what an
        # empty KV pool can promise once a page of rounding is counted (chapter 8)
        self.max_seq_len = min(self.engine.max_seq_len,
                               self.engine.num_pages * config.page_size - config.page_size + 1)
        self.table_manager = TableManager(config.max_running_req, self.engine.page_table)
        self.cache_manager = CacheManager(self.engine.num_pages, config.page_size,
                                          self.engine.page_table, config.cache_type)
        self.decode_manager = DecodeManager(config.page_size)
        self.prefill_manager = PrefillManager(self.cache_manager, self.table_manager,
                                              self.decode_manager)
        self.token_pool = self.table_manager.token_pool
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.stats = SchedulerStats()

    # -- the I/O a subclass provides: the offline LLM here, the server's process in chapter 14
    def receive_reqs(self, blocking: bool) -> list[PendingReq]:
        raise NotImplementedError

    def send_result(self, replies: list[TokenReply]) -> None:
        raise NotImplementedError

    def add_req(self, req: PendingReq) -> None:
        """Queue a request; its max_tokens is clipped to the room left in max_seq_len."""
        room = self.max_seq_len - req.input_len
        if room <= 0:
            raise ValueError(f"request {req.uid}: {req.input_len} prompt tokens leave no room for "
                             f"output within max_seq_len {self.max_seq_len}")
        if req.sampling_params.max_tokens > room:
            logger.info("request %d: max_tokens %d clipped to %d", req.uid,
                        req.sampling_params.max_tokens, room)
            req.sampling_params = dataclasses.replace(req.sampling_params, max_tokens=room)
        self.prefill_manager.add_one_req(req)

    @property
    def runnable(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    def normal_loop(self) -> None:
        """One step: schedule a batch, run it, wait for its tokens, hand them out."""
        for req in self.receive_reqs(blocking=not self.runnable):
            self.add_req(req)
        forward_input = self._schedule_next_batch()
        if forward_input is not None:
            self._process_last_data((forward_input, self._forward(forward_input)))

    @torch.inference_mode()
    def run_forever(self) -> NoReturn:
        """Loop until receive_reqs raises (the offline LLM does so once all are done)."""
        while True:
            self.normal_loop()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _schedule_next_batch(self) -> ForwardInput | None:
        """Prefill first (new requests start early), else decode every running request."""
        batch = (self.prefill_manager.schedule_next_batch()
                 or self.decode_manager.schedule_next_batch())
        return None if batch is None else self._prepare_batch(batch)

    def _prepare_batch(self, batch: Batch) -> ForwardInput:
        logger.debug("%-7s %s", batch.phase,
                     " ".join(f"{r.uid}+{r.extend_len}" for r in batch.reqs))
        batch.padded_reqs = batch.reqs  # padding to a captured graph size arrives in chapter 18
        self.cache_manager.allocate_paged(batch.reqs)
        pin = pin_memory(self.device)
        load = table_cells([(r.table_idx, r.cached_len, r.extend_len) for r in batch.padded_reqs],
                           self.device)  # the page-table cells of this batch's positions
        batch.positions = load[1].to(torch.int32)
        batch.out_loc = self.engine.page_table[load]
        # each sampled token goes to its request's next position; one that can never be read
        # (no decode follows: a prompt chunk, chapter 10) goes to a scratch column, the last
        write = ([r.table_idx for r in batch.reqs],
                 [r.device_len if r.can_decode else -1 for r in batch.reqs])
        write_indices = (_to_device(write[0], pin, self.device),
                         _to_device(write[1], pin, self.device))
        self.engine.attn_backend.prepare_metadata(batch)
        return ForwardInput(batch, self.engine.sampler.prepare(batch), load, write_indices)

    def _forward(self, forward_input: ForwardInput) -> ForwardOutput:
        batch = forward_input.batch
        batch.input_ids = self.token_pool[forward_input.load_indices]
        if batch.is_prefill:
            self.stats.prefill_batches += 1
            self.stats.prefill_tokens += sum(r.extend_len for r in batch.reqs)
            self.stats.cached_tokens += sum(r.cached_len for r in batch.reqs)
        else:
            self.stats.decode_batches += 1
        output = self.engine.forward_batch(batch, forward_input.sample_args)
        self.token_pool[forward_input.write_indices] = output.next_tokens_device
        self.decode_manager.filter_reqs(batch.reqs)
        if batch.is_prefill:  # the prompts' K/V go into the prefix cache at once, so the next
            for req in batch.reqs:  # batch's requests can match them
                self.cache_manager.cache_req(req, finished=False)
        return output

    def _process_last_data(self, data: ForwardData) -> None:
        forward_input, output = data
        output.copy_done.synchronize()
        replies: list[TokenReply] = []
        for i, req in enumerate(forward_input.batch.reqs):
            token = output.next_tokens_cpu[i]
            req.append_host(token)
            finished = not req.can_decode or (not req.sampling_params.ignore_eos
                                               and int(token) == self.eos_token_id)
            replies.append(TokenReply(req.uid, int(token), finished))
            if finished:
                self.decode_manager.remove_req(req)
                self.table_manager.free(req.table_idx)
                self.cache_manager.cache_req(req, finished=True)
        self.send_result(replies)


def _to_device(values: list[int], pin: bool, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64, pin_memory=pin)
    return host.to(device, non_blocking=True)
