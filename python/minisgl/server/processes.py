"""The server's child processes (chapter 15): the scheduler and tokenizer processes, their
ipc:// addresses, how they start, how the launcher watches them and how they stop."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.distributed import DistributedInfo
from minisgl.message.transport import IpcNamespace
from minisgl.scheduler.io import scheduler_worker
from minisgl.tokenizer import tokenizer_worker

from .args import ServerArgs
from .frontend import FrontendManager

logger = logging.getLogger("minisgl")
LOG_FORMAT = "%(asctime)s %(processName)s %(name)s: %(message)s"


@dataclass
class Child:
    name: str
    process: BaseProcess
    ready: Connection  # the child sends its name here once it serves


class Addresses:
    """The ipc:// sockets of one server, in its private folder, and where its
    tensor-parallel ranks meet: a file there, so no port can be taken already."""

    def __init__(self, ns: IpcNamespace) -> None:
        self.scheduler, self.detokenizer = ns.addr("scheduler"), ns.addr("detokenizer")
        self.tokenizer, self.frontend = ns.addr("tokenizer"), ns.addr("frontend")
        self.fanout, self.rendezvous = ns.addr("fanout"), f"file://{ns.root / 'rendezvous'}"


def start_children(args: ServerArgs, addr: Addresses, children: list[Child]) -> None:
    """The scheduler (one process per tensor-parallel rank), and the tokenizer: one process that
    also detokenizes, or with --num-tokenizer N a detokenizer and N workers that the API server
    feeds in turn.

    Each is appended to `children` once started, so that stop_children sees every one.

    Every child is forked from the launcher, which imported what they run (torch and
    transformers among it) with this module, so no child imports anything again. A fork copies
    only the calling thread: call this before the launcher starts a thread (uvicorn,
    asyncio.to_thread) or initialises CUDA (each scheduler rank does, after the fork)."""
    if threading.active_count() > 1:
        raise RuntimeError("start_children forks the launcher: call it before any thread starts")
    if "torch.cuda" in sys.modules and sys.modules["torch.cuda"].is_initialized():
        raise RuntimeError("start_children forks the launcher, which has initialised CUDA: a "
                           "forked child could not use the GPU; initialise it in the ranks")
    ctx = mp.get_context("fork")
    model, tp = args.scheduler.model_path, args.tp_size
    tok = dict(model_path=model, backend=addr.scheduler, frontend=addr.frontend)
    jobs: list[tuple[str, Callable[..., None], dict[str, Any]]] = [
        ("scheduler" if tp == 1 else f"scheduler-{rank}", scheduler_worker,
         dict(config=replace(args.scheduler, tp_info=DistributedInfo(rank, tp),
                             dist_init=addr.rendezvous if tp > 1 else ""),
              inbox=addr.scheduler, outbox=addr.detokenizer, fanout=addr.fanout))
        for rank in range(tp)]
    jobs += [
        ("detokenizer" if args.num_tokenizer else "tokenizer", tokenizer_worker,
         dict(tok, inbox=addr.detokenizer, bind_inbox=True, has_workers=args.num_tokenizer > 0))]
    jobs += [(f"tokenizer-{i}", tokenizer_worker, dict(tok, inbox=addr.tokenizer,
                                                      bind_inbox=False,
                                                      detokenizer=addr.detokenizer))
             for i in range(args.num_tokenizer)]
    for name, target, kwargs in jobs:
        ready_recv, ready_send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child_main, name=f"minisgl-{name}",
                              args=(target, dict(kwargs, ready=ready_send)))
        process.start()
        ready_send.close()  # the child holds the only writer: its death ends the pipe
        children.append(Child(name, process, ready_recv))


def _child_main(target: Callable[..., None], kwargs: dict[str, Any]) -> None:
    """Every child: Ctrl-C reaches the whole process group, but only the launcher acts on it
    (it stops the children with SIGTERM, in order); and a child dies with its launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        parent = mp.parent_process()
        if parent is not None and os.getppid() != parent.pid:
            return  # the launcher died before the line above: no signal will come, so leave
    # a child starts with logging unconfigured: its INFO lines (the attention backend
    # chosen, the graphs captured) would be dropped
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    target(**kwargs)


def stop_children(children: list[Child], timeout_s: float = 5.0) -> None:
    """SIGTERM to all (each closes its sockets and leaves), SIGKILL to any still there."""
    for c in children:
        if c.process.is_alive():
            c.process.terminate()
    deadline = time.monotonic() + timeout_s
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))
        if c.process.is_alive():
            logger.warning("%s did not stop in %.0f s: killed", c.name, timeout_s)
            c.process.kill()
            c.process.join()


async def watch(children: list[Child], manager: FrontendManager,
                on_failure: Callable[[str], None]) -> None:
    """Marks the manager ready once every child has said so; on a child's death, fails the
    manager (waiting clients get an error, new ones a 503) and calls on_failure."""
    waiting, start = {c.name for c in children}, time.monotonic()
    manager.processes = {"launcher": os.getpid()} | {c.name: c.process.pid or 0 for c in children}
    while True:
        if any(c.process.exitcode is not None for c in children):
            await asyncio.sleep(0.2)  # one rank's death ends its peers: see the whole cascade
            dead = sorted((c for c in children if c.process.exitcode is not None),
                          key=lambda c: (c.process.exitcode or 0) >= 0)  # a signal's first
            error = "; also gone: ".join(
                [f"the {dead[0].name} process (pid {dead[0].process.pid}) exited with code "
                 f"{dead[0].process.exitcode}"]
                + [", ".join(f"{c.name} (code {c.process.exitcode})" for c in dead[1:])] * (
                    len(dead) > 1))
            manager.fail(error)
            on_failure(error)
            return
        for c in children:
            if c.name in waiting and c.ready.poll():
                try:
                    c.ready.recv()
                    waiting.discard(c.name)
                except EOFError:  # it died before saying so: its exit code comes next round
                    pass
        if not waiting and manager.state == "starting":
            manager.state = "ready"
            logger.info("ready: %s in %.1f s", ", ".join(c.name for c in children),
                        time.monotonic() - start)
        await asyncio.sleep(0.1)
