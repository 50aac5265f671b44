"""FrontendManager (chapter 15): the API server's end of the sockets. A uid per request, a reply
list and an event per uid, one listener task that files every reply under its uid."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortMsg,
    BatchFrontendMsg,
    FrontendMsg,
    StatsMsg,
    StatsReply,
    TokenizeMsg,
    TokenizerMsg,
    UserReply,
)
from minisgl.message.transport import ZmqAsyncPullQueue, ZmqAsyncPushQueue

from .protocol import APIError

logger = logging.getLogger(__name__)


@dataclass
class _Inbox:
    """Replies that came for one uid and were not read yet; `event` wakes their reader."""

    replies: list[UserReply | StatsReply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)


class FrontendManager:
    """Made inside the server's event loop. `state` is what /health reports: "starting" until
    every process is ready, then "ready"; "stopping" or "failed: ..." at the end."""

    def __init__(self, to_tokenizer: str, bind_to_tokenizer: bool, from_tokenizer: str,
                 max_requests: int | None = None) -> None:
        self.max_requests = max_requests  # requests in flight at most (--max-queued-requests)
        self.requests = 0  # in flight now: submitted, not yet finished or given up
        self.to_tokenizer = ZmqAsyncPushQueue[TokenizerMsg](to_tokenizer, bind_to_tokenizer)
        self.from_tokenizer: ZmqAsyncPullQueue[FrontendMsg] = ZmqAsyncPullQueue(
            from_tokenizer, bind=True, expected=FrontendMsg)
        self.uids = itertools.count()
        self.inboxes: dict[int, _Inbox] = {}
        self.state = "starting"
        self.processes: dict[str, int] = {}  # name -> pid, shown by /debug/processes
        self.sending: set[asyncio.Task[None]] = set()  # aborts on their way (kept referenced)
        self.closed = False
        self.listener = asyncio.get_running_loop().create_task(self._listen())
        self.listener.add_done_callback(self._listener_ended)

    def _listener_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # a bug: say so, hang no one
            logger.error("the reply listener failed: %r", task.exception())
            self.fail(f"the reply listener failed: {task.exception()!r}")

    async def _listen(self) -> None:
        while True:
            msg = await self.from_tokenizer.get()
            for reply in msg.data if isinstance(msg, BatchFrontendMsg) else [msg]:
                inbox = self.inboxes.get(reply.uid)
                if inbox is None:  # its client went away, and the request was aborted
                    continue
                inbox.replies.append(reply)
                inbox.event.set()

    async def submit(self, prompt: str | list[dict[str, str]] | list[int],
                     params: SamplingParams, stop: list[str], cache_salt: str = "") -> int:
        """Send a request on; an APIError if the queue is full (429) or it cannot be sent."""
        if self.max_requests is not None and self.requests >= self.max_requests:
            raise APIError(429, f"{self.requests} requests are in flight already "
                           "(--max-queued-requests); retry later", kind="rate_limit_error",
                           headers={"Retry-After": "1"})
        uid = next(self.uids)
        self.inboxes[uid] = _Inbox()  # before sending: its first reply may come at any await
        try:  # encoded before the first await: nothing is sent if this fails
            await self.to_tokenizer.put(TokenizeMsg(uid, prompt=prompt, sampling_params=params,
                                                    stop=stop, cache_salt=cache_salt))
        except (TypeError, ValueError, OverflowError) as e:  # a value msgpack cannot carry
            del self.inboxes[uid]
            raise APIError(400, f"the request cannot be sent to the tokenizer: {e}") from None
        self.requests += 1
        return uid

    async def batches(self, uid: int) -> AsyncGenerator[list[UserReply], None]:
        """The request's replies in order, up to the finished one, as lists: each holds every
        reply that had come when its reader woke. A reader that keeps up gets one reply at a
        time; one that falls behind (a loaded server) gets several and can send them in one
        write. Leaving early (the client went away: the reader is cancelled or closes this
        generator) aborts the request."""
        inbox, finished = self.inboxes[uid], False
        try:
            while not finished:
                await inbox.event.wait()
                inbox.event.clear()  # nothing runs in between: no reply can be missed
                batch, inbox.replies = inbox.replies, []
                for i, reply in enumerate(batch):
                    assert isinstance(reply, UserReply)
                    if reply.finished:  # nothing after it belongs to the request
                        finished, batch = True, batch[:i + 1]
                        break
                yield batch  # type: ignore[misc]
        finally:
            del self.inboxes[uid]
            self.requests -= 1
            if not finished:
                self.abort(uid)

    async def replies(self, uid: int) -> AsyncGenerator[UserReply, None]:
        """The same replies one at a time (closing this closes, and so aborts, the request)."""
        async with aclosing(self.batches(uid)) as batches:
            async for batch in batches:
                for reply in batch:
                    yield reply

    def abort(self, uid: int) -> None:
        """Tell the scheduler to free the request. Not a coroutine: it is called while the
        request's task is being cancelled, when awaiting is no longer possible."""
        if self.closed:  # shutting down: the scheduler goes away too
            return
        task = asyncio.get_running_loop().create_task(self.to_tokenizer.put(AbortMsg(uid)))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def stats(self, timeout_s: float = 10.0) -> StatsReply | None:
        """The scheduler's own account of its rows and pages (a debug endpoint shows it); None
        if it did not answer in time, or a process died meanwhile."""
        uid = next(self.uids)
        inbox = self.inboxes[uid] = _Inbox()
        try:
            await self.to_tokenizer.put(StatsMsg(uid))
            await asyncio.wait_for(inbox.event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            del self.inboxes[uid]
        reply = inbox.replies[0]
        return reply if isinstance(reply, StatsReply) else None

    def fail(self, error: str) -> None:
        """A process died: every request waiting gets an error, and no new one is taken."""
        self.state = f"failed: {error}"
        self.end_all(error)

    def end_all(self, error: str) -> None:
        """Every request in flight ends now with an error: a stream gets an error event and
        [DONE], a whole answer a 503 (a failure, or the end of a drain on shutdown)."""
        for uid, inbox in self.inboxes.items():
            inbox.replies.append(UserReply(uid, incremental_output="", finished=True,
                                           finish_reason="error", error=error))
            inbox.event.set()

    def close(self) -> None:
        self.closed = True
        self.listener.cancel()
        self.to_tokenizer.close()
        self.from_tokenizer.close()
