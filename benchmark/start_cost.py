"""What one server start costs, engine by engine in turns: the seconds until /health answers 200,
and the CPU seconds of every process the server ran (the launcher, its children, and helpers
such as a fork server or multiprocessing's resource tracker) from the start until the last of
them has exited after SIGTERM, with one chat request of 8 tokens in between.

This process makes itself the subreaper of everything it starts (PR_SET_CHILD_SUBREAPER), so a
helper that outlives the launcher is reaped here and its CPU is counted too (Linux only).

    python benchmark/start_cost.py --model models/tiny-qwen3 --rounds 5 \
        --engine forkserver=OLD/python --engine fork=python --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from ch11_speed import cpu_model  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(package: Path, model: Path) -> dict[str, float]:
    """Start, wait for ready, one request, SIGTERM, reap every descendant: the three figures."""
    port, tmp = free_port(), tempfile.mkdtemp(prefix="start-cost-")
    env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=os.pathsep.join(
        [str(package.resolve()), os.environ.get("PYTHONPATH", "")]))
    cpu0, t0 = children_cpu(), time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--model", str(model), "--port", str(port),
         "--max-seq-len-override", "512", "--num-pages", "8192"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server of {package} exited with {proc.returncode} before ready")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    ready = time.monotonic() - t0
    body = json.dumps({"model": "m", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200, r.status
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    while True:  # the helpers the launcher left behind are ours to reap: wait for all of them
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    gone_s = time.monotonic() - t1
    if left := os.listdir(tmp):  # the server's private ipc folder was here: none may remain
        print(f"{package}: the stopped server left {left} in {tmp}")
    else:
        os.rmdir(tmp)
    return {"ready_s": ready, "cpu_s": children_cpu() - cpu0, "gone_s": gone_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--engine", action="append", required=True, metavar="NAME=PYTHON_DIR",
                   help="a python/ folder holding a minisgl package; repeat, taken in turns")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if sys.platform != "linux":
        raise SystemExit("needs Linux (PR_SET_CHILD_SUBREAPER)")
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
    engines = dict(e.split("=", 1) for e in args.engine)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    names = list(engines)
    with tqdm(total=args.rounds * len(names), desc="server starts", file=sys.stderr) as bar:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # the first rotates
                runs[name].append(one_start(Path(engines[name]), args.model))
                bar.update()
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs; model {args.model.name}; "
          f"{args.rounds} rounds in turns, median (min-max)")
    print(f"{'engine':<12} {'ready s':>18} {'CPU s, all processes':>24} "
          f"{'gone after SIGTERM s':>22}")
    for name, rs in runs.items():
        cells = []
        for key in ("ready_s", "cpu_s", "gone_s"):
            xs = [x[key] for x in rs]
            cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
        print(f"{name:<12} {cells[0]:>18} {cells[1]:>24} {cells[2]:>22}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model.name), "engines": engines,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
