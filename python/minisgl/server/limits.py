"""What a client may do and use (chapter 15): the API key, loopback Host names, JSON bodies,
readiness, and the limits on connections, header and body reads."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/openapi.json")  # answered without the key, before ready
JSON_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None  # Bearer token every route but OPEN_PATHS needs; None: no key
    loopback_only: bool = True  # bound to a loopback address: refuse other Host names
    max_request_bytes: int = 1 << 20  # 413 above
    max_connections: int = 2048  # open connections; one more is answered 503 and closed
    max_queued_requests: int = 1024  # the flag's default: requests beyond the running ones
    max_requests: int | None = None  # in flight at most (running + queued); 429 above
    header_timeout_s: float = 10.0  # request line and headers must arrive within this (408)
    body_timeout_s: float = 30.0  # most time between two parts of a body (408)
    shutdown_timeout_s: float = 30.0  # on SIGTERM, time for requests in flight to finish
    enable_debug: bool = False  # /debug/* routes: the scheduler's stats, the processes


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Guard:
    """ASGI middleware that refuses, in this order and in OpenAI's error shape: a Host that is
    not a loopback name (when bound to loopback: DNS rebinding), a missing or wrong key (401),
    any route but /health before the server is ready or while it drains (503), a body that is
    not JSON (415). It also times the reads of the body (408) and logs, in one line, a client
    that goes away before its body is complete."""

    def __init__(self, app: ASGIApp, limits: Limits, state: Callable[[], str]) -> None:
        self.app, self.limits, self.state = app, limits, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        error = self.refusal(scope["path"], scope["method"], headers)
        if error is not None:
            return await send_error(send, error)
        await self.app(scope, self._timed(receive, scope), send)

    def refusal(self, path: str, method: str, headers: dict[str, str]) -> APIError | None:
        host = _host_name(headers.get("host", "localhost"))
        if self.limits.loopback_only and not is_loopback(host):
            return APIError(400, f"Host {host!r} is not a loopback name; this server listens on "
                            "a loopback address only (--host to serve other machines)", "host")
        if path in OPEN_PATHS:
            return None
        if self.limits.api_key is not None and not self._authorized(headers):
            return APIError(401, "a valid API key is needed: send the header "
                            "'Authorization: Bearer <key>'", kind="invalid_request_error",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        state = self.state()
        if state != "ready":
            why = "starting" if state == "starting" else "shutting down"
            return APIError(503, f"the server is {why}; retry later",
                            kind="service_unavailable", headers={"Retry-After": "1"})
        if _length(headers) > self.limits.max_request_bytes:
            return APIError(413, self._too_large)
        if method == "POST" and path in JSON_PATHS:
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"the body must be JSON (Content-Type: application/json), "
                                f"not {kind or 'nothing'!r}", "content-type")
        return None

    @property
    def _too_large(self) -> str:
        return f"the body is over {self.limits.max_request_bytes} bytes (--max-request-bytes)"

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        assert self.limits.api_key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.limits.api_key.encode())

    def _timed(self, receive: Receive, scope: Scope) -> Receive:
        """receive, with body_timeout_s for each part of the body, and a 413 once the parts
        add up to more than max_request_bytes (a chunked body has no Content-Length)."""
        body_done, size = False, 0

        async def timed() -> Message:
            nonlocal body_done, size
            if body_done:  # the disconnect watch of a running request: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.limits.body_timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"no part of the body came for "
                                    f"{self.limits.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                size += len(message.get("body", b""))
                if size > self.limits.max_request_bytes:
                    raise HTTPException(413, self._too_large)
            elif message["type"] == "http.disconnect":
                logger.info("a client (%s) went away before its request was complete",
                            _client(scope))
                body_done = True
            return message
        return timed


def _length(headers: dict[str, str]) -> int:
    """Content-Length, 0 if absent (h11 refuses a malformed one before we see it)."""
    value = headers.get("content-length", "0").strip()
    return int(value) if value.isdigit() else 0


def _host_name(host: str) -> str:
    if host.startswith("["):  # [::1]:port
        return host[1:].partition("]")[0]
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() else host


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown"


async def send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def raw_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for the protocol level (no app)."""
    body = json.dumps(error.body()).encode()
    phrase = {408: "Request Timeout", 503: "Service Unavailable"}.get(error.status, "Error")
    extra = "".join(f"{k}: {v}\r\n" for k, v in error.headers.items())
    head = (f"HTTP/1.1 {error.status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n")
    return head.encode() + body


def guarded_protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with two limits it lacks: a connection over max_connections is
    answered 503 and closed, and one whose request line and headers have not all come within
    header_timeout_s (slowloris) is answered 408 and closed."""

    class GuardedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                error = APIError(503, f"more than {limits.max_connections} connections are "
                                 "open (--max-connections); retry later",
                                 kind="service_unavailable", headers={"Retry-After": "1"})
                transport.write(raw_response(error))
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are all in
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(limits.header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _too_slow(self) -> None:
            self.header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            logger.info("a client (%s) sent no complete request headers in %g s: closed",
                        self.client and f"{self.client[0]}:{self.client[1]}",
                        limits.header_timeout_s)
            self.transport.write(raw_response(APIError(
                408, f"the request headers did not all come within {limits.header_timeout_s:g} s")))
            self.transport.close()

    return GuardedH11Protocol


def add_flags(p: argparse.ArgumentParser) -> None:
    """The command-line flags of Limits."""
    d = Limits()
    p.add_argument("--api-key", default=os.environ.get("MINISGL_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (every route but /health "
                   "and /openapi.json); default: $MINISGL_API_KEY, else no key")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body; larger ones get 413")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at most; one more is answered 503 and closed")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting beyond --max-running-requests; more get 429")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds for a request's line and headers to arrive (408 after)")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds between two parts of a request body (408 after)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="on SIGTERM, seconds for requests in flight to finish before each is "
                   "ended with an error; a second signal stops at once")
    p.add_argument("--enable-debug", action="store_true",
                   help="serve /debug/scheduler and /debug/processes (behind the key)")


def from_flags(a: argparse.Namespace, max_running_requests: int) -> Limits:
    for flag in ("max_request_bytes", "max_connections", "header_timeout", "body_timeout"):
        if getattr(a, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    if a.max_queued_requests < 0 or a.shutdown_timeout < 0:
        raise ValueError("--max-queued-requests and --shutdown-timeout must be 0 or more")
    return Limits(api_key=a.api_key or None, loopback_only=is_loopback(a.host),
                  max_request_bytes=a.max_request_bytes, max_connections=a.max_connections,
                  max_requests=max_running_requests + a.max_queued_requests,
                  header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout,
                  shutdown_timeout_s=a.shutdown_timeout, enable_debug=a.enable_debug)
