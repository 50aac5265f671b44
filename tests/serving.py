"""The server harness of the server tests: `python -m minisgl` in a subprocess, HTTP over
loopback, the openai client, and a check that its processes are gone (chapter 15)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import psutil

MAX_SEQ_LEN = 512  # the servers' context: long enough to be aborted mid-way, short to test
STOP_S = 30  # how long a stopping server may take before a test calls it hung


# `python -m minisgl` whose scheduler process waits argv[1] seconds before it starts, as a large
# model's load would: the launcher has forked it and serves HTTP meanwhile
HELD_START = """import runpy, sys, time
import minisgl.server.launch as launch
processes = sys.modules[launch.start_children.__module__]
worker, held_s = processes.scheduler_worker, float(sys.argv.pop(1))
def held(**kwargs):
    time.sleep(held_s)
    worker(**kwargs)
processes.scheduler_worker = held
runpy.run_module("minisgl", run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m minisgl` in a subprocess, its ipc folder and log under `tmp`."""

    def __init__(self, model: Path, tmp: Path, *flags: str, debug: bool = True,
                 held_s: float = 0.0) -> None:
        """debug: serve /debug/* (the tests read the processes and the scheduler's stats);
        held_s: the scheduler process starts that much later (HELD_START)."""
        self.tmp, self.port = tmp, free_port()
        package_root = Path(importlib.util.find_spec("minisgl").origin).parent.parent
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(
            [str(package_root), os.environ.get("PYTHONPATH", "")]))
        self.log = tmp / "server.log"
        with open(self.log, "wb") as log:
            start = ["-c", HELD_START, str(held_s)] if held_s else ["-m", "minisgl"]
            self.proc = subprocess.Popen(
                [sys.executable, *start, "--model", str(model), "--port", str(self.port),
                 "--max-seq-len-override", str(MAX_SEQ_LEN), "--num-pages", "8192",
                 *(["--enable-debug"] if debug else []), *flags],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.health: dict[str, Any] = {}
        self.processes: dict[str, int] = {}  # name -> pid, from /debug/processes once ready

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                timeout: float = 30, headers: dict[str, str] | None = None
                ) -> tuple[int, bytes]:
        """One HTTP request; a body goes as JSON unless headers say otherwise."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            sent = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=sent | (headers or {}))
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float = 180) -> list[int]:
        """Polls /health until 200; returns the statuses seen on the way."""
        seen, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                status, body = self.request("GET", "/health", timeout=5)
                seen.append(status)
                if status == 200:
                    self.health = json.loads(body)
                    status, body = self.request("GET", "/debug/processes", timeout=5)
                    self.processes = json.loads(body) if status == 200 else {}
                    return seen
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                             _strict_response_validation=True, max_retries=0, **kw)

    def stats(self) -> dict[str, Any]:
        status, body = self.request("GET", "/debug/scheduler")
        assert status == 200, body
        return json.loads(body)

    def stop(self) -> int:
        """SIGTERM, then the exit code; a server that is not gone within STOP_S is killed and the
        test fails (the bound is for a loaded 2-core machine, where an idle stop takes seconds)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def pids(self) -> list[int]:
        return list(self.processes.values())


def gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
