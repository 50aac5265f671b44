"""The Scheduler (chapter 7): admits requests, builds batches, runs them, hands out tokens.
Around that loop: admission control, prefix caching, chunked prefill, the overlap loop, aborts
and retraction."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import NamedTuple, NoReturn

import torch
from transformers import AutoTokenizer

from minisgl.core import Batch, FinishReason, Req
from minisgl.engine import BatchSamplingArgs, Engine, ForwardOutput
from minisgl.utils.device import (
    create_event,
    create_stream,
    set_current_stream,
    stream_context,
    synchronize,
    to_device,
)

from .admission import NewTokenRatio, generated_len, retraction_order
from .cache import CacheManager, table_cells
from .config import SchedulerConfig
from .decode import DecodeManager
from .prefill import ChunkedReq, PrefillManager
from .table import TableManager
from .trace import LaunchProfile, StepTrace
from .utils import PendingReq, SchedulerStats, TokenReply

logger = logging.getLogger(__name__)
ABORT_MARK_TTL_S = 60.0  # an abort mark nothing claims is dropped after this
Indices2D = tuple[torch.Tensor, torch.Tensor]  # (rows, columns) of the page table / token pool


class ForwardInput(NamedTuple):
    """A prepared batch. Kept until its results are processed: its index tensors were made on
    the scheduler's stream and are read on the engine's, so their memory must not be reused
    before the batch is done."""

    batch: Batch
    sample_args: BatchSamplingArgs
    load_indices: Indices2D  # where its input tokens are: (row, position) per token
    write_indices: Indices2D  # where its sampled tokens go: (row, device_len) per request


ForwardData = tuple[ForwardInput, ForwardOutput]


class Scheduler:
    decode_between_chunks = False  # the server turns it on

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.device = self.engine.device
        # the most prompt + output tokens a request may have: the engine's limit, and what an
        # empty KV pool can promise once a page of rounding is counted
        self.max_seq_len = min(self.engine.max_seq_len,
                               self.engine.num_pages * config.page_size - config.page_size + 1)
        # the scheduler works on its own stream, so preparing batch N+1 overlaps batch N
        self.stream = create_stream(self.device)
        set_current_stream(self.stream)
        self.table_manager = TableManager(config.max_running_req, self.engine.page_table)
        self.cache_manager = CacheManager(self.engine.num_pages, config.page_size,
                                          self.engine.page_table, config.cache_type)
        # None ("conservative"): running requests keep all their remaining output and are
        # never retracted
        self.ratio = (NewTokenRatio(config.schedule_conservativeness)
                      if config.admission == "expected" else None)
        self.decode_manager = DecodeManager(config.page_size, self.ratio)
        self.prefill_manager = PrefillManager(self.cache_manager, self.table_manager,
                                              self.decode_manager)
        self.token_pool = self.table_manager.token_pool
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.overlap = os.environ.get("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0") != "1"
        self.finished_reqs: set[Req] = set()  # finished while the next batch was in flight
        # retracted (or failed) while a batch holding them may be in flight: its token for them
        # is dropped, and their rows are freed once it is processed
        self.retracted: list[Req] = []
        self.aborted: dict[int, float] = {}  # uid -> when; stopped at its next token
        self.stats = SchedulerStats()
        self.decode_turn = False  # the last batch was a prefill (see _schedule_next_batch)
        self.flowing: set[int] = set()  # uids running when this run of prefill steps began
        self.trace = StepTrace.from_env()  # MINISGL_STEP_TRACE=file: per-step timings
        self.launch_profile = LaunchProfile.from_env()  # MINISGL_LAUNCH_PROFILE=file[:n]

    # -- the I/O a subclass provides: the offline LLM's, or the server process's
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

    def abort_req(self, uid: int) -> None:
        """Stop a request wherever it is. Waiting: it leaves the queue at once, with the row
        and pages of any prompt chunks already computed. Finished in the batch just processed:
        nothing to do. Otherwise it is marked. A running request's next token finishes it on
        the usual path, once the batch in flight no longer needs its row and pages; a request
        not here yet (its abort overtook it) is answered when it comes. A mark nothing claims
        within ABORT_MARK_TTL_S (its request had finished earlier) is dropped."""
        for i, pending in enumerate(self.prefill_manager.pending):
            if pending.uid == uid:
                del self.prefill_manager.pending[i]
                if pending.chunked_req is not None:
                    self._release(pending.chunked_req)
                self.send_result([TokenReply(uid, -1, True, "abort")])
                return
        now = time.monotonic()
        self.aborted = {u: t for u, t in self.aborted.items() if now - t < ABORT_MARK_TTL_S}
        if not any(r.uid == uid for r in self.finished_reqs):
            self.aborted[uid] = now

    def _release(self, req: Req) -> None:
        """A finished request gives back its table row; its K/V go to the prefix cache."""
        self.decode_manager.remove_req(req)
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)

    @property
    def runnable(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    @property
    def new_token_ratio(self) -> float:
        """The share of their remaining output running requests are expected to use (1 when
        admission is conservative)."""
        return 1.0 if self.ratio is None else self.ratio.value

    def normal_loop(self) -> None:
        """One step: schedule a batch, run it, wait for its tokens, hand them out."""
        for req in self.receive_reqs(blocking=not self.runnable):
            self.add_req(req)
        forward_input = self._schedule_next_batch()
        data = None
        if forward_input is not None:
            with self._launching(forward_input.batch):
                output = self._forward(forward_input)
                self._after_launch(forward_input.batch)
            data = (forward_input, output)
        self._process_last_data(data)

    def overlap_loop(self, last_data: ForwardData | None) -> ForwardData | None:
        """One step: schedule and launch batch N+1, then process batch N's tokens while the
        device computes. Batch N+1 reads its input tokens from the token pool, where batch N
        wrote them on the device, so it never waits for the host."""
        trace = self.trace
        if trace is not None:
            trace.begin()
        for req in self.receive_reqs(blocking=last_data is None and not self.runnable):
            self.add_req(req)
        if trace is not None:
            trace.mark()
        if last_data is not None and last_data[0].batch.is_prefill:
            last_data = self._hand_out_if_ready(last_data)  # first tokens: before scheduling
        forward_input = self._schedule_next_batch()
        if trace is not None:
            trace.mark()
            if forward_input is not None:
                trace.launched(forward_input.batch)
        if last_data is not None and forward_input is not None and forward_input.batch.is_prefill:
            last_data = self._hand_out_if_ready(last_data)  # before a long launch
        ongoing = None
        if forward_input is not None:
            with self._launching(forward_input.batch):
                with stream_context(self.engine.stream):
                    # the batch's inputs are ready (both streams come from create_stream on one
                    # device: both CUDA streams, or both NullStreams)
                    self.engine.stream.wait_stream(self.stream)  # type: ignore[arg-type]
                    output = self._forward(forward_input)
                # back on our stream: the bookkeeping after launch edits page-table rows and
                # the free list, which the next batch's preparation (on our stream) reads
                self._after_launch(forward_input.batch)
            ongoing = (forward_input, output)
        if trace is not None:
            trace.mark()
            if last_data is not None:  # the wait, timed apart from handing out the tokens
                last_data[1].copy_done.synchronize()
            trace.mark()
        self._process_last_data(last_data)
        if trace is not None:
            trace.mark()
            trace.end()
        return ongoing

    def _hand_out_if_ready(self, last_data: ForwardData) -> ForwardData | None:
        """Batch N's tokens, handed out now if already on the host, not after N+1's launch.
        Asked before N+1 is scheduled when N was a prefill (first tokens: the order without
        overlap), and after when N+1 is a prefill (a long eager launch, which holds none of
        N's requests). Returns what is left to process after the launch."""
        if not last_data[1].copy_done.query():
            return last_data
        began = time.perf_counter()
        self._process_last_data(last_data)
        if self.trace is not None:
            self.trace.handed_out_early(began, time.perf_counter())
        return None

    @torch.inference_mode()
    def run_forever(self) -> NoReturn:
        """Loop until receive_reqs raises (the offline LLM does so once all are done)."""
        if not self.overlap:
            with stream_context(self.engine.stream):
                self.engine.stream.wait_stream(self.stream)  # type: ignore[arg-type]
                while True:
                    self.normal_loop()
        data = None
        while True:
            data = self.overlap_loop(data)

    def shutdown(self) -> None:
        synchronize(self.device)  # nothing may still run when the engine lets go of its memory
        self.engine.shutdown()
        if self.trace is not None:
            self.trace.write()
        if self.launch_profile is not None:
            self.launch_profile.write()

    def _launching(self, batch: Batch) -> contextlib.AbstractContextManager[None]:
        """The launch of `batch`, profiled when MINISGL_LAUNCH_PROFILE asks for it."""
        if self.launch_profile is None:
            return contextlib.nullcontext()
        return self.launch_profile.launch(batch)

    def _schedule_next_batch(self) -> ForwardInput | None:
        """Prefill first (new requests start early), else decode every running request. With
        `decode_between_chunks` (the server's), while prompts wait the running requests get
        every other step, so their streams slow down instead of stopping, when someone needs
        it: streams that were flowing when this run of prefill steps began (the prefill steps
        they wait for are then kept to streaming_extend_tokens), or everyone when a single
        prompt is longer than a step. A wave of short prompts on an otherwise idle server is
        filled back to back with the whole budget: the streams it starts pause once after
        their first token, not once per chunk (each pause is a gap the p99 gap counts)."""
        batch = None
        if self.decode_between_chunks and self.decode_turn and self._turn_needed():
            batch = self._schedule_decode()
        if batch is None and self.prefill_manager.runnable:
            if self.decode_between_chunks and not self.decode_turn:  # a run of prefills begins
                self.flowing = set(self.decode_manager.running)
            # A prefill may reuse the table row of a request that finished while the batch now
            # in flight still writes its last token there: let our stream's copies into that
            # row wait for it (a device-side wait; the host goes on).
            self.stream.wait_stream(self.engine.stream)  # type: ignore[arg-type]
            batch = self.prefill_manager.schedule_next_batch(self._prefill_budget())
        batch = batch or self._schedule_decode()
        self.decode_turn = batch is not None and batch.is_prefill
        return None if batch is None else self._prepare_batch(batch)

    def _turn_needed(self) -> bool:
        """Do the prompts still waiting owe the running requests a decode step?"""
        prefill = self.prefill_manager
        return prefill.runnable and (
            prefill.filling_longer_than(self.config.max_extend_tokens) or self._streams_wait())

    def _streams_wait(self) -> bool:
        """Are streams that were flowing before this run of prefill steps still running?"""
        return not self.flowing.isdisjoint(self.decode_manager.running)

    def _prefill_budget(self) -> int:
        """Prompt tokens for the next prefill step: streaming_extend_tokens (when set) while
        flowing streams wait on it, so their gap is one small prefill step and a decode step."""
        limit = self.config.streaming_extend_tokens
        if limit and self.decode_between_chunks and self._streams_wait():
            return min(limit, self.config.max_extend_tokens)
        return self.config.max_extend_tokens

    def _schedule_decode(self) -> Batch | None:
        """The running requests' decode batch. Admitted by expected need, they may lack the
        pages of this step: then the fewest are retracted (_make_room), unless a prompt is
        part-way through its prefill (the server's decode turn between its chunks): that
        prompt was promised its pages, so if the rest does not fit the decode waits a step."""
        if self.ratio is not None and self.decode_manager.runnable:
            if self.prefill_manager.chunking:
                if not self._decode_fits(self.decode_manager.reqs):
                    return None
                self.ratio.decay()
            elif not self._make_room():
                self.ratio.decay()  # a step that fitted as it was: guess a little lower
        return self.decode_manager.schedule_next_batch()

    def _decode_fits(self, reqs: list[Req]) -> bool:
        """Can these requests take the pages of one decode step (a page for each one whose
        next token starts a page), beside what a chunked prompt was promised? Evictable
        prefix-cache pages count as available. A decode step takes at most one page per
        request: when that many fit, the exact count (a pass over the requests) is skipped."""
        cache = self.cache_manager
        room = cache.available_size - self.prefill_manager.promised_tokens(cache.page_size)
        if len(reqs) * cache.page_size <= room:
            return True
        return cache.pages_needed(reqs) * cache.page_size <= room

    def _make_room(self) -> bool:
        """Retract running requests, in retraction_order, until the others fit this decode
        step. One is always kept; if it cannot fit alone, it fails (the KV pool is too small
        for it: max_seq_len rules that out, so this is a last resort). Returns whether the
        step did not fit as it was (requests retracted, or one failed); logs each retraction
        in one line."""
        reqs = self.decode_manager.reqs
        if self._decode_fits(reqs):
            return False
        assert self.ratio is not None  # only admission by expected need over-commits pages
        order, victims = retraction_order(reqs), []
        available, old_ratio = self.cache_manager.available_size, self.ratio.value
        while not self._decode_fits(order):
            if len(order) == 1:
                self._fail(order.pop(), "the KV pool is too small for this request alone; give "
                           "the server more KV pages (--num-pages) or ask for fewer tokens")
                break
            victims.append(order.pop(0))
            self._take_back(victims[-1])
        if not victims:
            return True  # the one request left failed: not a step to lower the guess after
        self._requeue(victims)
        self.ratio.after_retraction(order)
        self.stats.retractions += 1
        self.stats.retracted_reqs += len(victims)
        logger.warning("KV cache pool is full: retracted %d request(s) (uids %s), %d KV tokens "
                       "freed; new-token ratio %.4f -> %.4f (raise --schedule-conservativeness "
                       "if this is frequent)", len(victims), " ".join(str(v.uid) for v in victims),
                       self.cache_manager.available_size - available, old_ratio, self.ratio.value)
        return True

    def _take_back(self, req: Req) -> None:
        """A running request gives back what it holds: its computed prefix goes to the prefix
        cache (so its recompute is mostly a cache hit), the rest of its pages to the free
        list. Its row waits until the batch in flight, which may still write its next token
        there, has been processed; that token is dropped then (see _process_last_data)."""
        self.decode_manager.remove_req(req)
        self.cache_manager.cache_req(req, finished=True)
        self.retracted.append(req)

    def _requeue(self, victims: list[Req]) -> None:
        """The retracted requests wait again, first in the queue, in uid order: each with its
        prompt and the tokens it generated as input, and what is left of max_tokens as output,
        under its own uid and sampling parameters. One whose client went away meanwhile (an
        abort mark, set before this step) is answered now instead."""
        requeued: list[PendingReq] = []
        for req in sorted(victims, key=lambda r: r.uid):
            if self.aborted.pop(req.uid, None) is not None:
                self.send_result([TokenReply(req.uid, -1, True, "abort")])
                continue
            assert req.cache_handle is not None  # a running request holds its cache handle
            requeued.append(PendingReq(req.uid, req.input_ids.clone(), req.sampling_params,
                                       cache_salt=req.cache_handle.salt,
                                       generated=generated_len(req),
                                       retractions=req.retractions + 1))
        self.prefill_manager.requeue(requeued)

    def _fail(self, req: Req, error: str) -> None:
        """End a running request that cannot go on, with an error its client sees."""
        logger.error("request %d fails: %s", req.uid, error)
        self.aborted.pop(req.uid, None)
        self._take_back(req)
        self.send_result([TokenReply(req.uid, -1, True, "abort", error=error)])

    def _prepare_batch(self, batch: Batch) -> ForwardInput:
        logger.debug("%-7s %s", batch.phase,
                     " ".join(f"{r.uid}+{r.extend_len}" for r in batch.reqs))
        self.engine.graph_runner.pad(batch)  # dummies up to a captured size
        self.cache_manager.allocate_paged(batch.reqs)
        load = table_cells([(r.table_idx, r.cached_len, r.extend_len) for r in batch.padded_reqs],
                           self.device)  # the page-table cells of this batch's positions
        batch.positions = load[1].to(torch.int32)
        batch.out_loc = self.engine.page_table[load]
        # each sampled token goes to its request's next position; one that can never be read
        # (no decode follows: a prompt chunk) goes to a scratch column, the last
        write = ([r.table_idx for r in batch.reqs],
                 [r.device_len if r.can_decode else -1 for r in batch.reqs])
        write_indices = (to_device(write[0], torch.int64, self.device),
                         to_device(write[1], torch.int64, self.device))
        self.engine.attn_backend.prepare_metadata(batch)
        return ForwardInput(batch, self.engine.sampler.prepare(batch), load, write_indices)

    def _forward(self, forward_input: ForwardInput) -> ForwardOutput:
        batch = forward_input.batch
        batch.input_ids = self.token_pool[forward_input.load_indices]
        if batch.is_prefill:
            self.stats.prefill_batches += 1
            self.stats.prefill_tokens += sum(r.extend_len for r in batch.reqs)
            self.stats.recomputed_tokens += sum(r.extend_len for r in batch.reqs if r.retractions)
            # a prompt's first part starts right after its cached prefix; the later parts of a
            # chunked prompt start further on and found nothing new in the cache; a retracted
            # request's prompt was counted when it first came
            self.stats.cached_tokens += sum(r.cached_len for r in batch.reqs
                                            if r.cache_handle is not None and not r.retractions
                                            and r.cached_len == r.cache_handle.cached_len)
        else:
            self.stats.decode_batches += 1
        output = self.engine.forward_batch(batch, forward_input.sample_args)
        self.token_pool[forward_input.write_indices] = output.next_tokens_device
        # "done" must also cover the scatter just issued, not only the copy to the host
        done = create_event(self.device)
        done.record(self.engine.stream)  # type: ignore[arg-type]
        return output._replace(copy_done=done)

    def _after_launch(self, batch: Batch) -> None:
        self.decode_manager.filter_reqs(batch.reqs)
        if batch.is_prefill:  # the prompts' K/V go into the prefix cache at once, so the next
            for req in batch.reqs:  # batch's requests can match them
                if not isinstance(req, ChunkedReq):
                    self.cache_manager.cache_req(req, finished=False)

    def _process_last_data(self, data: ForwardData | None) -> None:
        if data is not None:
            self._process_tokens(*data)
        # the batch that may have held the requests retracted this step is done with their rows
        for req in self.retracted:
            self.table_manager.free(req.table_idx)
        self.retracted = []
        if not self.runnable and self.ratio is not None:
            self.ratio.reset()  # nothing left to schedule: the next requests start afresh

    def _process_tokens(self, forward_input: ForwardInput, output: ForwardOutput) -> None:
        output.copy_done.synchronize()
        replies: list[TokenReply] = []
        newly_finished: set[Req] = set()
        tokens = output.next_tokens_cpu.tolist()  # one conversion, not one tensor per request
        for req, value in zip(forward_input.batch.reqs, tokens):
            # a chunk's token means nothing; a request that finished in the previous step was
            # already in this batch (it was scheduled before we knew) and is not reported twice;
            # a retracted one computes this token again when it comes back
            if isinstance(req, ChunkedReq) or req in self.finished_reqs or req in self.retracted:
                continue
            req.append_host(value)
            # counted on the host: with overlap, device_len already includes the batch in flight
            reason = _finish_reason(req, value, self.eos_token_id)
            if self.aborted.pop(req.uid, None) is not None:  # its token is dropped, and
                reason, value = "abort", -1  # its row and pages come back
            replies.append(TokenReply(req.uid, next_token=value, finished=reason is not None,
                                      finish_reason=reason))
            if reason is not None:
                newly_finished.add(req)
                self._release(req)
        self.finished_reqs = newly_finished
        self.send_result(replies)


def _finish_reason(req: Req, token: int, eos_token_id: int) -> FinishReason | None:
    """"stop" at the EOS (unless ignored), "length" at max_tokens or the context's end."""
    if not req.sampling_params.ignore_eos and token == eos_token_id:
        return "stop"
    return "length" if req.host_len >= req.max_device_len else None

