"""Helpers that the tests (and some mains) of several chapters share: a global Context for a
block (chapters 1-5), a model that records its logits and HF's cached greedy reference (3-5),
the batches the scheduler logged (8, 15), chat answers from the server, one question asked of a
fresh server (the mains of 17-19) and what a killed one leaves behind (15-16), TP ranks on real
processes (16, 20, 22), a `--shell` session (18-20), the fake GPU libraries (19-20) and a copy
event that is never ready (21).

It imports minisgl and serving only where a helper runs, so that it loads in every tree that
holds it."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest
import torch

from reference import hf_greedy

if TYPE_CHECKING:
    import openai

    from minisgl.core import Context

    from serving import Server

FAKES = Path(__file__).resolve().parent / "fakes"  # chapter 17's flashinfer and sgl_kernel
FAKE_MODULES = ("flashinfer", "sgl_kernel", "sgl_kernel.flash_attn")


class BusyEvent:
    """A copy event that never says it is done, as while a GPU still computes (the CPU's
    NullEvent always is). Waiting on it returns at once: the work is done on the CPU."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


@contextmanager
def global_ctx(page_size: int) -> Iterator[Context]:
    """A global Context for the duration of the block; always removed afterwards."""
    from minisgl.core import Context, get_global_ctx, set_global_ctx

    set_global_ctx(Context(page_size=page_size))
    try:
        yield get_global_ctx()
    finally:
        set_global_ctx(None)


class Forward(Protocol):
    """A model as the generate loops call it: forward() reads the batch from the Context."""

    def forward(self) -> torch.Tensor: ...


class Recorder:
    """Stands in for the model in a generate loop and keeps every step's logits."""

    def __init__(self, model: Forward) -> None:
        self.model = model
        self.logits: list[torch.Tensor] = []

    def forward(self) -> torch.Tensor:
        out = self.model.forward()
        self.logits.append(out.clone())
        return out


@cache
def hf_reference(path: Path, prompt: tuple[int, ...]) -> tuple[list[int], list[torch.Tensor]]:
    """HF's 16 greedy tokens and logits for one prompt, computed once per session."""
    return hf_greedy(path, list(prompt), 16)


def batches(caplog: pytest.LogCaptureFixture) -> list[tuple[str, list[int]]]:
    """(phase, [uid, ...]) of every batch the scheduler logged."""
    out = []
    for record in caplog.records:
        if record.name == "minisgl.scheduler.scheduler" and record.levelno == logging.DEBUG:
            phase, *reqs = record.getMessage().split()
            out.append((phase, [int(r.split("+")[0]) for r in reqs]))
    return out


def questions(n: int) -> list[list[dict[str, str]]]:
    """n one-message chats, each asking something else."""
    return [[{"role": "user", "content": f"Question {i}: {'xyz'[i % 3] * (i + 1)}?"}]
            for i in range(n)]


def chat_answer(client: openai.OpenAI, chat: list[dict[str, str]], stream: bool,
                max_tokens: int, ignore_eos: bool = True) -> str:
    """The greedy answer to `chat`, asked in one piece or streamed."""
    # chat, not completions: the SDK's strict Completion type refuses the finish_reason
    # null that every streamed completion chunk but the last must carry
    out = client.chat.completions.create(model="tiny", messages=chat, max_tokens=max_tokens,
                                         temperature=0, stream=stream,
                                         extra_body={"ignore_eos": ignore_eos})
    if not stream:
        return out.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


def ask_server(model: Path, tmp: Path, question: str, *flags: str,
               max_tokens: int) -> tuple[str, int, Server]:
    """Start `python -m minisgl` on `model` with `flags`, stream its greedy answer to one
    question (EOS ends it) and stop it: the answer, the exit code and the stopped server (its
    log and the pids it had)."""
    from serving import Server

    server = Server(model, tmp, *flags)
    try:
        server.wait_ready()
        chat = [{"role": "user", "content": question}]
        text = chat_answer(server.client(), chat, stream=True, max_tokens=max_tokens,
                           ignore_eos=False)
    finally:
        code = server.stop()
    return text, code, server


def assert_cleaned_up_after_kill(server: Server, name: str, tmp_path: Path,
                                 within_s: float) -> None:
    """After process `name` of a server was SIGKILLed and the server stopped: the log names the
    dead process, every process is gone within within_s and only server.log is left."""
    from serving import gone

    pid = server.processes[name]
    assert f"the {name} process (pid {pid}) exited with code -9" in server.log.read_text()
    assert gone(server.pids(), within_s)
    assert not [p for p in tmp_path.iterdir() if p.name != "server.log"]


def _rank_main(environ: dict[str, str], path: list[str], target: Callable[..., None],
               *args: object) -> None:
    """One rank's process: the test's environment and import path as they are now (the fork
    server's own were taken when it started), then target."""
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    target(*args)


def run_ranks(target: Callable[..., None], size: int, tmp_path: Path, *args: object,
              timeout_s: float = 120) -> tuple[list[tuple], list[int | None]]:
    """target(rank, size, rendezvous, *args, out) on `size` processes: what they put in `out`,
    in the order it came, failing at once if a rank dies or when not all came within
    timeout_s; and the ranks' exit codes. Every process is gone when this returns.

    The ranks fork from a fork server that imported target's module (and with it torch) once
    for this test process: a spawned rank would import them again, seconds of CPU each. Not
    from this process itself, as the server's children fork from its launcher (chapter 15):
    a test has already run torch's compute threads here, which a forked child may not get."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([target.__module__])  # taken when the fork server first starts
    out = ctx.Queue()
    tmp_path.mkdir(parents=True, exist_ok=True)
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank_main, args=(dict(os.environ), list(sys.path), target, r,
                                                  size, rendezvous, *args, out))
             for r in range(size)]
    results: list[tuple] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < size and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=0.5))
            except queue.Empty:
                assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert len(results) == size, f"{len(results)} of {size} results in {timeout_s} s"
    return results, [p.exitcode for p in procs]


@contextmanager
def fake_gpu_libraries(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fake flashinfer and sgl_kernel of chapter 17 on the import path, for one test."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in FAKE_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)


def shell_session(model: Path, tmp_path: Path, *flags: str, timeout: float = 120,
                  **env: str) -> str:
    """`python -m minisgl --shell *flags`, asked "hello" and then /exit: it must exit 0, say it
    is ready and answer. Returns its stderr (the scheduler process logs there)."""
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(model), "--shell", *flags,
         "--max-seq-len-override", "64"], input="hello\n/exit\n", capture_output=True,
        text=True, timeout=timeout, env=dict(os.environ, TMPDIR=str(tmp_path), **env))
    assert out.returncode == 0, out.stderr[-2000:]
    ready, answer = out.stdout.split("\n", 1)
    assert "is ready" in ready and len(answer.strip()) > 0
    return out.stderr
