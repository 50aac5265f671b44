"""The first token's last hop in isolation: the time from "the first reply is here" (an
asyncio.Event set on the server's loop) to the client's first body byte, on FastAPI + uvicorn
over loopback, three ways taken in turns:

  after:  the handler waits for the reply, then builds the StreamingResponse (ours: an error
          can still be a 4xx);
  before: the handler returns the StreamingResponse at once, its generator waits for the
          reply (the official: the headers are out before the prefill ends);
  held:   the handler returns at once a response that holds its status line until the reply
          is here (an error can still be a 4xx), then sends headers and the first event.

    python benchmark/first_write.py --rounds 400
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ch11_speed import cpu_model  # noqa: E402

CHUNK = b"data: x\n\n"
app = FastAPI()
shared: dict[str, object] = {}


async def _one_chunk() -> AsyncIterator[bytes]:
    yield CHUNK


async def _after_event(event: asyncio.Event) -> AsyncIterator[bytes]:
    await event.wait()
    yield CHUNK


@app.get("/after")
async def after() -> StreamingResponse:
    event = shared["event"] = asyncio.Event()
    await event.wait()
    return StreamingResponse(_one_chunk(), media_type="text/event-stream")


@app.get("/before")
async def before() -> StreamingResponse:
    event = shared["event"] = asyncio.Event()
    return StreamingResponse(_after_event(event), media_type="text/event-stream")


class _Held(StreamingResponse):
    """Sends nothing, headers included, until `event` is set."""

    def __init__(self, event: asyncio.Event) -> None:
        super().__init__(_one_chunk(), media_type="text/event-stream")
        self.event = event

    async def stream_response(self, send: Any) -> None:
        await self.event.wait()
        await super().stream_response(send)


@app.get("/held")
async def held() -> StreamingResponse:
    event = shared["event"] = asyncio.Event()
    return _Held(event)


@app.get("/loop")
async def loop() -> dict[str, str]:
    shared["loop"] = asyncio.get_running_loop()
    return {}


def one(port: int, path: str) -> float:
    """Milliseconds from setting the event to the chunk at the client."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"GET /{path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        time.sleep(0.02)  # the handler is waiting; for /before the headers are already out
        got = b""
        if path == "before":
            while b"\r\n\r\n" not in got:
                got += s.recv(4096)
        server_loop, event = shared["loop"], shared["event"]
        assert isinstance(server_loop, asyncio.AbstractEventLoop)
        assert isinstance(event, asyncio.Event)
        t0 = time.perf_counter()
        server_loop.call_soon_threadsafe(event.set)
        while CHUNK not in got:
            got += s.recv(4096)
        return (time.perf_counter() - t0) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    threading.Thread(target=uvicorn.Server(config).run, daemon=True).start()
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/loop").read()
            break
        except OSError:
            time.sleep(0.1)
    times: dict[str, list[float]] = {"after": [], "before": [], "held": []}
    for r in range(args.warmup + args.rounds):
        order = list(times)
        for path in order[r % 3:] + order[:r % 3]:
            ms = one(port, path)
            if r >= args.warmup:
                times[path].append(ms)
    print(f"machine: {cpu_model()}; {args.rounds} requests each, in turns, after "
          f"{args.warmup} warm-up rounds")
    for path, xs in times.items():
        xs.sort()
        print(f"{path:<7} event -> first body byte: median {statistics.median(xs):.3f} ms, "
              f"p10 {xs[len(xs) // 10]:.3f}, p90 {xs[len(xs) * 9 // 10]:.3f}")


if __name__ == "__main__":
    main()
