"""The scheduler as a server process: requests and aborts in over ZMQ, tokens out (chapter 14)."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import torch

from minisgl.core import prompt_error
from minisgl.distributed import broadcast
from minisgl.message import (
    AbortBackendMsg,
    BackendItem,
    BackendMsg,
    BatchBackendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    StatsMsg,
    StatsReply,
    TokenizerItem,
    UserMsg,
)
from minisgl.message.transport import ZmqPubQueue, ZmqPullQueue, ZmqPushQueue, ZmqSubQueue
from minisgl.utils.signals import exit_on_sigterm

from .config import SchedulerConfig
from .scheduler import Scheduler
from .utils import PendingReq, TokenReply

logger = logging.getLogger(__name__)


class SchedulerExit(Exception):
    """An ExitMsg arrived: leave run_forever."""


class ServerScheduler(Scheduler):
    """The same loop as the offline LLM: only the two I/O hooks differ. Requests
    come from the tokenizer process, tokens go to the detokenizer, one frame per step.

    With tensor parallelism every rank runs this loop on the same messages, so all
    step through the same batches: rank 0 receives, forwards each frame as it is to the other
    ranks (ZMQ PUB/SUB on `fanout`) and broadcasts how many it forwarded; only rank 0 replies."""

    decode_between_chunks = True  # running streams keep flowing while a long prompt fills

    def __init__(self, config: SchedulerConfig, inbox: str, outbox: str, fanout: str = "") -> None:
        super().__init__(config)
        self.vocab_size = config.model_config.vocab_size
        self.tp = config.tp_info
        self.inbox: ZmqPullQueue[BackendMsg] | ZmqSubQueue[BackendMsg]
        self.outbox: ZmqPushQueue[BatchTokenizerMsg] | None = None
        self.fanout: ZmqPubQueue[BackendMsg] | None = None
        if self.tp.is_primary:
            self.inbox = ZmqPullQueue(inbox, bind=True, expected=BackendMsg)
            self.outbox = ZmqPushQueue(outbox, bind=False)
            if self.tp.size > 1:
                self.fanout = ZmqPubQueue(fanout, bind=True)
        else:
            self.inbox = ZmqSubQueue(fanout, bind=False, expected=BackendMsg)
        if self.tp.size > 1:  # nothing is published before every rank has subscribed
            if self.fanout is not None:
                self.fanout.wait_subscribers(self.tp.size - 1)
            broadcast(torch.zeros(1))  # a barrier on the host group
        self.aborted_reqs = 0  # requests ended by an abort, for the stats

    def _receive_frames(self, blocking: bool) -> list[bytes]:
        """The frames that arrived, the same list on every rank. Waits (for the first) only when
        there is nothing to run; every rank knows that alike, since all run the same batches."""
        if self.tp.is_primary:
            frames: list[bytes] = []
            while (f := self.inbox.get_raw(None if blocking and not frames else 0)) is not None:
                frames.append(f)
                if self.fanout is not None:
                    self.fanout.put_raw(f)
            if self.tp.size > 1:
                broadcast(torch.tensor([len(frames)]))
            return frames
        first = [self.inbox.get_raw()] if blocking else []  # rank 0 published it already
        count = int(broadcast(torch.zeros(1, dtype=torch.int64)))
        return first + [self.inbox.get_raw() for _ in range(count - len(first))]

    def receive_reqs(self, blocking: bool) -> list[PendingReq]:
        """Whatever has arrived; waits only when there is nothing to run."""
        msgs: list[BackendItem] = []
        for frame in self._receive_frames(blocking):
            if (msg := self.inbox.accept(frame)) is not None:  # malformed: refused on every rank
                msgs += msg.data if isinstance(msg, BatchBackendMsg) else [msg]
        reqs: list[PendingReq] = []
        answers: list[TokenizerItem] = []  # sent at once, in one frame
        for m in msgs:
            if isinstance(m, ExitMsg):
                raise SchedulerExit
            try:
                if isinstance(m, AbortBackendMsg):
                    self.abort_req(m.uid)
                elif isinstance(m, StatsMsg):  # blocking: nothing to run and nothing in flight
                    answers.append(self._stats(m.uid, idle=blocking))
                elif self.aborted.pop(m.uid, None) is not None:  # its abort overtook it
                    self.send_result([TokenReply(m.uid, next_token=-1, finished=True,
                                                 finish_reason="abort")])
                elif (error := self._check(m)) is not None:
                    answers.append(_refusal(m.uid, error))
                else:
                    reqs.append(PendingReq(m.uid, m.input_ids, m.sampling_params,
                                           cache_salt=m.cache_salt))
            except Exception as e:  # a bug that one message hit: it fails, the server goes on
                logger.exception("scheduler: message %s failed", type(m).__name__)
                if isinstance(m, UserMsg):
                    answers.append(_refusal(m.uid, f"internal error: {type(e).__name__}"))
        if answers and self.outbox is not None:
            self.outbox.put(BatchTokenizerMsg(answers))
        return reqs

    def _stats(self, uid: int, idle: bool) -> StatsReply:
        """How the scheduler stands; when idle, with its own integrity check, so
        a test can see every row and page come back after clients went away."""
        integrity = None
        if idle:
            try:
                self.cache_manager.check_integrity()
                if self.table_manager.available_size != self.config.max_running_req:
                    raise RuntimeError(f"{self.table_manager.available_size} of "
                                       f"{self.config.max_running_req} table rows are free")
                integrity = "ok"
            except RuntimeError as e:
                integrity = str(e)
        cache = self.cache_manager
        return StatsReply(uid=uid, idle=idle, aborted=self.aborted_reqs,
                          waiting=len(self.prefill_manager.pending),
                          running=len(self.decode_manager.running),
                          free_rows=self.table_manager.available_size,
                          total_rows=self.config.max_running_req,
                          free_pages=len(cache.free_slots), total_pages=cache.num_pages,
                          integrity=integrity, cached_tokens=self.stats.cached_tokens,
                          retractions=self.stats.retractions,
                          retracted_reqs=self.stats.retracted_reqs,
                          recomputed_tokens=self.stats.recomputed_tokens,
                          new_token_ratio=self.new_token_ratio)

    def _check(self, msg: UserMsg) -> str | None:
        """Why a request can never run here, or None. Answered at once: a request is never
        dropped in silence, and nothing in the loop raises because of one."""
        n = len(msg.input_ids)
        if (error := prompt_error(n, self.max_seq_len)) is not None:
            return error
        if int(msg.input_ids.min()) < 0 or int(msg.input_ids.max()) >= self.vocab_size:
            return f"token ids must be in [0, {self.vocab_size})"
        asked = msg.sampling_params.max_tokens  # max_seq_len itself: "as many as fit"
        if asked < self.config.max_seq_len and n + asked > self.max_seq_len:
            return (f"the prompt has {n} tokens and max_tokens is {asked}: {n + asked} in all, "
                    f"over this server's context of {self.max_seq_len} tokens; ask for at most "
                    f"{self.max_seq_len - n} or shorten the prompt")
        return None

    def send_result(self, replies: list[TokenReply]) -> None:
        self.aborted_reqs += sum(r.finish_reason == "abort" for r in replies)
        if replies and self.outbox is not None:  # only rank 0 replies
            self.outbox.put(BatchTokenizerMsg([
                DetokenizeMsg(uid=r.uid, next_token=r.next_token, finished=r.finished,
                              finish_reason="error" if r.error else r.finish_reason,
                              error=r.error) for r in replies]))

    def shutdown(self) -> None:
        super().shutdown()
        for queue in (self.inbox, self.outbox, self.fanout):
            if queue is not None:
                queue.close()


def _refusal(uid: int, error: str) -> DetokenizeMsg:
    """The only message a request that cannot run gets: finished, with no token."""
    return DetokenizeMsg(uid=uid, next_token=-1, finished=True, finish_reason="error",
                         error=error)


def scheduler_worker(config: SchedulerConfig, inbox: str, outbox: str,
                     ready: Connection | None = None, fanout: str = "") -> None:
    """The scheduler process's main (one per tensor-parallel rank): serve until an ExitMsg or
    SIGTERM."""
    exit_on_sigterm()  # unwinds run_forever: the finally clause shuts the engine down
    scheduler = ServerScheduler(config, inbox, outbox, fanout)
    if ready is not None:
        ready.send("scheduler")
    try:
        scheduler.run_forever()
    except SchedulerExit:
        logger.info("scheduler: exit requested")
    finally:
        scheduler.shutdown()
