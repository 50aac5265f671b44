"""ZMQ queues between the server's processes, and ipc:// addresses unique to one server
(chapter 12)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Generic, TypeVar

import zmq
import zmq.asyncio

from minisgl.message import MessageError, decode, encode

WAKE_MS = 100  # a receiver waiting "forever" wakes this often (see _Receiver.wait)
T = TypeVar("T")
Q = TypeVar("Q", bound="_Queue")
logger = logging.getLogger(__name__)


class IpcNamespace:
    """A private folder for one server's ipc:// sockets: two servers on one machine never share
    an address, and removing the folder removes every socket file at once."""

    def __init__(self, root: str | None = None) -> None:
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="minisgl-"))
        self.root.mkdir(parents=True, exist_ok=True)

    def addr(self, name: str) -> str:
        return f"ipc://{self.root / name}"

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class _Queue:
    """One socket, bound (the side that owns the address) or connected. Closed with linger 0:
    messages still queued when a process shuts down are dropped, not waited for."""

    def __init__(self, ctx: zmq.Context, kind: int, addr: str, bind: bool) -> None:
        self.addr = addr
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        if bind:
            self.socket.bind(addr)
        else:
            self.socket.connect(addr)

    def close(self) -> None:
        self.socket.close()

    def __enter__(self: Q) -> Q:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Receiver(_Queue, Generic[T]):
    def __init__(self, ctx: zmq.Context, kind: int, addr: str, bind: bool,
                 expected: type[T]) -> None:
        super().__init__(ctx, kind, addr, bind)
        self.expected, self.refused = expected, 0

    def wait(self, timeout_ms: int | None) -> bool:
        """Whether a frame is ready within timeout_ms (None: however long it takes). Polls in
        slices of WAKE_MS: Python runs a signal handler only when the main thread runs Python,
        and a SIGTERM the kernel hands to another thread (torch's, the tokenizers') would not
        end a poll that never returns."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            left = WAKE_MS if deadline is None else (deadline - time.monotonic()) * 1000
            if self.socket.poll(max(0, min(WAKE_MS, int(left)))) != 0:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _accept(self, frame: bytes) -> T | None:
        """The message in a frame, or None (logged and counted) for a malformed one: one bad
        sender must not stop a receiver that serves every request."""
        try:
            return decode(frame, self.expected)
        except MessageError as e:
            self.refused += 1
            logger.warning("%s: refused a frame of %d bytes: %s", self.addr, len(frame), e)
            return None


class ZmqPushQueue(_Queue, Generic[T]):
    def __init__(self, addr: str, bind: bool) -> None:
        super().__init__(zmq.Context.instance(), zmq.PUSH, addr, bind)

    def put(self, msg: T) -> None:
        self.socket.send(encode(msg), copy=False)


class ZmqPullQueue(_Receiver[T]):
    def __init__(self, addr: str, bind: bool, expected: type[T]) -> None:
        super().__init__(zmq.Context.instance(), zmq.PULL, addr, bind, expected)

    def get(self, timeout_ms: int | None = None) -> T | None:
        """The next well-formed message; None if none came within timeout_ms (None: wait)."""
        while self.wait(timeout_ms):
            msg = self._accept(self.socket.recv())
            if msg is not None:
                return msg
        return None

    def get_raw(self, timeout_ms: int | None = None) -> bytes | None:
        """The next frame, undecoded (rank 0 forwards it to the other ranks as it is)."""
        return self.socket.recv() if self.wait(timeout_ms) else None

    def empty(self) -> bool:
        return self.socket.poll(0) == 0


class ZmqPubQueue(_Queue, Generic[T]):
    """Rank 0's broadcast to the other ranks of a tensor-parallel scheduler (chapter 16)."""

    def __init__(self, addr: str, bind: bool) -> None:
        super().__init__(zmq.Context.instance(), zmq.PUB, addr, bind)

    def put(self, msg: T) -> None:
        self.socket.send(encode(msg), copy=False)

    def put_raw(self, frame: bytes) -> None:
        self.socket.send(frame, copy=False)


class ZmqSubQueue(_Receiver[T]):
    def __init__(self, addr: str, bind: bool, expected: type[T]) -> None:
        super().__init__(zmq.Context.instance(), zmq.SUB, addr, bind, expected)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")  # every message

    def get(self) -> T:
        while True:
            self.wait(None)
            if (msg := self._accept(self.socket.recv())) is not None:
                return msg


class ZmqAsyncPushQueue(_Queue, Generic[T]):
    """The API server's side: sending never blocks its event loop."""

    def __init__(self, addr: str, bind: bool) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PUSH, addr, bind)

    async def put(self, msg: T) -> None:
        await self.socket.send(encode(msg), copy=False)


class ZmqAsyncPullQueue(_Receiver[T]):
    def __init__(self, addr: str, bind: bool, expected: type[T]) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PULL, addr, bind, expected)

    async def get(self) -> T:
        while (msg := self._accept(await self.socket.recv())) is None:
            pass
        return msg
