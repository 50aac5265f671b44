"""ZMQ queues between the server's processes (chapter 12), and ipc:// addresses unique to one
server."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from types import UnionType
from typing import Generic, TypeVar, overload

import zmq
import zmq.asyncio

from .codec import MessageError, decode, encode

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

    def __init__(self, ctx: zmq.Context, kind: int, addr: str, bind: bool,
                 options: dict[int, int] | None = None) -> None:
        self.addr = addr
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():  # before bind/connect, or they do not apply
            self.socket.setsockopt(option, value)
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
                 expected: type[T] | UnionType, options: dict[int, int] | None = None) -> None:
        super().__init__(ctx, kind, addr, bind=bind, options=options)
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

    @overload
    def get_raw(self, timeout_ms: None = None) -> bytes: ...
    @overload
    def get_raw(self, timeout_ms: int | None) -> bytes | None: ...

    def get_raw(self, timeout_ms: int | None = None) -> bytes | None:
        """The next frame, undecoded (rank 0 forwards it to the other ranks as it is); None if
        none came within timeout_ms (None: wait)."""
        return self.socket.recv() if self.wait(timeout_ms) else None

    def accept(self, frame: bytes) -> T | None:
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
    def __init__(self, addr: str, bind: bool, expected: type[T] | UnionType) -> None:
        super().__init__(zmq.Context.instance(), zmq.PULL, addr, bind=bind, expected=expected)

    def get(self, timeout_ms: int | None = None) -> T | None:
        """The next well-formed message; None if none came within timeout_ms (None: wait)."""
        while self.wait(timeout_ms):
            msg = self.accept(self.socket.recv())
            if msg is not None:
                return msg
        return None

    def empty(self) -> bool:
        return self.socket.poll(0) == 0


class ZmqPubQueue(_Queue, Generic[T]):
    """Rank 0's broadcast to the other ranks of a tensor-parallel scheduler. No
    high-water mark: a PUB socket drops what is over it, and a rank that misses one frame would
    leave the lockstep. XPUB: it sees each subscription arrive (see wait_subscribers)."""

    def __init__(self, addr: str, bind: bool) -> None:
        # XPUB_VERBOSE: report every subscription, not only the first to a topic
        super().__init__(zmq.Context.instance(), zmq.XPUB, addr, bind=bind,
                         options={zmq.SNDHWM: 0, zmq.XPUB_VERBOSE: 1})

    def wait_subscribers(self, n: int, timeout_s: float = 60.0) -> None:
        """Block until n subscribers have subscribed: a frame published earlier is lost to
        a subscriber still connecting (ZMQ's "slow joiner")."""
        deadline = time.monotonic() + timeout_s
        while n > 0:
            if self.socket.poll(WAKE_MS) and self.socket.recv()[:1] == b"\x01":
                n -= 1
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{self.addr}: {n} subscriber(s) missing after {timeout_s} s")

    def put(self, msg: T) -> None:
        self.socket.send(encode(msg), copy=False)

    def put_raw(self, frame: bytes) -> None:
        self.socket.send(frame, copy=False)


class ZmqSubQueue(_Receiver[T]):
    def __init__(self, addr: str, bind: bool, expected: type[T] | UnionType) -> None:
        super().__init__(zmq.Context.instance(), zmq.SUB, addr, bind=bind, expected=expected,
                         options={zmq.RCVHWM: 0})  # see ZmqPubQueue
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")  # every message

    def get(self) -> T:
        while True:
            self.wait(None)
            if (msg := self.accept(self.socket.recv())) is not None:
                return msg


class ZmqAsyncPushQueue(_Queue, Generic[T]):
    """The API server's side: sending never blocks its event loop."""

    def __init__(self, addr: str, bind: bool) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PUSH, addr, bind)

    async def put(self, msg: T) -> None:
        await self.socket.send(encode(msg), copy=False)


class ZmqAsyncPullQueue(_Receiver[T]):
    def __init__(self, addr: str, bind: bool, expected: type[T] | UnionType) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PULL, addr, bind=bind,
                         expected=expected)

    async def get(self) -> T:
        while (msg := self.accept(await self.socket.recv())) is None:
            pass
        return msg
