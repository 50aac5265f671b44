"""The launcher (chapter 15): starts the scheduler and tokenizer processes, serves HTTP (or the
shell) once every one is ready, and stops them all on the way out, whatever ends it; the
children log at INFO."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from minisgl.message.transport import IpcNamespace
from minisgl.utils.signals import exit_on_sigterm

from .api_server import create_app
from .args import ServerArgs, parse_args
from .frontend import FrontendManager
from .limits import guarded_protocol
from .processes import LOG_FORMAT, Addresses, Child, start_children, stop_children, watch
from .shell import run_shell

logger = logging.getLogger("minisgl")


class _Server(uvicorn.Server):
    """uvicorn's server, with our first signal: drain (see `drain`), not stop; the second stops
    at once."""

    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_first_signal, self.draining = on_first_signal, False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining or self.should_exit:
            self._captured_signals.append(sig)
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self._captured_signals.append(sig)  # raised again once serving ends: main() exits
        asyncio.get_running_loop().call_soon_threadsafe(self.on_first_signal)


async def drain(manager: FrontendManager, server: uvicorn.Server, timeout_s: float) -> None:
    """Stop taking requests (every route but /health answers 503), let those in flight finish
    for up to timeout_s, end each one left with an error (a stream: an error event and [DONE]),
    then let uvicorn close the connections."""
    manager.state = "stopping"
    left, deadline = manager.requests, time.monotonic() + timeout_s
    logger.info("stopping: %d requests in flight get up to %.0f s to finish", left, timeout_s)
    while manager.requests and time.monotonic() < deadline and not server.force_exit:
        await asyncio.sleep(0.05)
    if manager.requests:
        logger.warning("stopping: %d requests still in flight after %.0f s end with an error",
                       manager.requests, timeout_s)
        manager.end_all(f"the server is shutting down: the request was stopped after "
                        f"--shutdown-timeout {timeout_s:g} s")
        deadline = time.monotonic() + 5  # their handlers write the error and [DONE]
        while manager.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    server.should_exit = True


async def serve(args: ServerArgs, addr: Addresses, children: list[Child]) -> int:
    """HTTP until SIGINT/SIGTERM (0, after a drain) or a child's death (1), for the children
    just started. Until every one is ready, every route but /health answers 503."""
    limits = args.limits
    manager = FrontendManager(addr.tokenizer if args.num_tokenizer else addr.detokenizer,
                              args.num_tokenizer > 0, addr.frontend, limits.max_requests)
    app = create_app(args.model_name, args.scheduler.max_seq_len, lambda: manager, limits)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            http=guarded_protocol(limits), timeout_graceful_shutdown=5)
    draining: list[asyncio.Task[None]] = []
    server = _Server(config, lambda: draining.append(asyncio.create_task(
        drain(manager, server, limits.shutdown_timeout_s))))
    failures: list[str] = []

    def failed(error: str) -> None:
        failures.append(error)
        server.should_exit = True

    watcher = asyncio.create_task(watch(children, manager, failed))
    logger.info("serving %s on http://%s:%d (starting; /health answers 503 until ready)",
                args.model_name, args.host, args.port)
    try:
        await server.serve()
    finally:
        watcher.cancel()
        for task in draining:
            task.cancel()
        if not manager.state.startswith("failed"):
            manager.state = "stopping"
        manager.close()
    if failures:
        logger.error("%s; the server stops", failures[0])
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    exit_on_sigterm()  # unwinds main(), whose finally stops the children; uvicorn takes
    # SIGTERM over while it serves, then re-raises it
    ns = IpcNamespace()
    children: list[Child] = []
    try:
        start_children(args, Addresses(ns), children)  # forks: before any thread starts
        if args.shell:
            return asyncio.run(run_shell(args, Addresses(ns), children))
        return asyncio.run(serve(args, Addresses(ns), children))
    except KeyboardInterrupt:
        return 0
    finally:
        stop_children(children)
        ns.remove()
        logger.info("stopped")
