"""Fairness of chunked prefill: how the chunk size (`--max-prefill-length N`, the prompt tokens
one prefill step computes) changes the flow of short streams while one long prompt prefills.

For each chunk size N and each repeat the script starts a fresh server (`python -m minisgl
--model MODEL --max-prefill-length N`, PYTHONPATH = this checkout's python/) and runs two phases
on it:

* without: K clients, each streaming short requests to /v1/completions one after another
  (a short prompt of random token ids, max_tokens M, temperature 0, ignore_eos), for a fixed
  window;
* with: the same clients, and at the start of the window one long prompt (L random token ids in
  [100, 10000), max_tokens 1, not streamed); the window ends `--tail` seconds after every
  client has received a chunk after the long request completed.

The arrival time of every streamed chunk is recorded. ITL (inter-token latency) is the gap
between two successive chunks with text in one stream (so the first chunk with text starts the
series and is not itself a gap); a gap counts in a window when it ends inside it. Per phase the
report has the short streams' ITL p50/p99/max, their tokens/s (chunks with text in the window
over its length), the longest silence (the largest gap between any two chunks of any stream in
the window) and, for "with", the long prompt's time to completion. Each long prompt is new
(fresh random ids), so the prefix cache never shortens it. The order of the phases alternates
from one repeat to the next (without, with; then with, without); repeat 1 runs every chunk size,
then repeat 2 does for each size whose first repeat's time still fits in --budget-min. The table
gives medians and, in brackets, the range over the repeats. The JSON file keeps every raw
figure, the machine, the date, the git commit and the load average (os.getloadavg) at the start
and end of each configuration and phase: on a small shared machine other work adds noise.

    python benchmark/fairness.py                       # the full run (about 25 min on 2 cores)
    python benchmark/fairness.py --chunks 8192 512 --repeats 1 --json /tmp/f.json
    python benchmark/fairness.py --quick               # smoke test, < 60 s; numbers meaningless
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
ID_RANGE = (100, 10000)  # prompt token ids are drawn from [100, 10000)


# ---------------------------------------------------------------- clients


@dataclass
class Stream:
    """One streamed short request: when it was sent, when each chunk with text came."""

    client: int
    sent: float
    chunks: list[float] = field(default_factory=list)  # perf_counter times
    usage_tokens: int = 0  # completion_tokens from the final usage chunk
    error: str = ""


def post(port: int, body: dict[str, Any], timeout: float) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def stream_once(port: int, s: Stream, prompt: list[int], max_tokens: int,
                timeout: float) -> Stream:
    """Sends one streamed completion and times its chunks into s (which others may read while
    it fills)."""
    body = {"model": "any", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    s.sent = time.perf_counter()
    try:
        resp = post(port, body, timeout)
        if resp.status != 200:
            s.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return s
        done = False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            now, data = time.perf_counter(), line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                s.error = f"error event: {json.dumps(event['error'])[:300]}"
                return s
            choices = event.get("choices") or [{}]
            if choices[0].get("text"):
                s.chunks.append(now)
            if event.get("usage"):
                s.usage_tokens = int(event["usage"]["completion_tokens"])
        if not done:
            s.error = "the stream ended without [DONE]"
    except (OSError, ValueError) as e:  # ValueError: a chunk that is not JSON
        s.error = f"{type(e).__name__}: {e}"
    return s


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*ID_RANGE) for _ in range(n)]


class Clients:
    """K threads, each sending short streamed requests back to back until stopped; a request in
    flight when stop() is called runs to its end."""

    def __init__(self, port: int, k: int, prompt_len: int, max_tokens: int, seed: int,
                 timeout: float) -> None:
        self.streams: list[Stream] = []  # finished ones
        self.current: dict[int, Stream] = {}  # each client's stream in flight
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(
            target=self._loop, args=(port, i, prompt_len, max_tokens, seed * 1000 + i, timeout),
            daemon=True) for i in range(k)]

    def _loop(self, port: int, client: int, prompt_len: int, max_tokens: int, seed: int,
              timeout: float) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            s = self.current[client] = Stream(client, time.perf_counter())
            stream_once(port, s, random_ids(rng, prompt_len), max_tokens, timeout)
            with self._lock:
                self.streams.append(s)
            if s.error:
                time.sleep(0.5)  # no tight loop against a failing server

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def all_heard_after(self, t: float) -> bool:
        """Has every client had a chunk with text after time t?"""
        with self._lock:
            streams = self.streams + list(self.current.values())
        heard = {s.client for s in streams if s.chunks and s.chunks[-1] > t}
        return len(heard) == len(self._threads)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def long_request(port: int, ids: list[int], timeout: float) -> dict[str, Any]:
    """One long prompt, max_tokens 1, not streamed: its status and time to completion."""
    body = {"model": "any", "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    out: dict[str, Any] = {"prompt_tokens": len(ids), "start": start}
    try:
        resp = post(port, body, timeout)
        text = resp.read()
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = text[:300].decode(errors="replace")
        else:
            out["usage"] = json.loads(text).get("usage")
    except (OSError, ValueError) as e:
        out["status"], out["error"] = None, f"{type(e).__name__}: {e}"
    out["end"] = time.perf_counter()
    out["latency_s"] = out["end"] - start
    return out


# ---------------------------------------------------------------- the server


class Server:
    """`python -m minisgl` with this checkout's package, on one port, for one chunk size."""

    def __init__(self, model: str, port: int, chunk: int, log_dir: str,
                 extra: list[str]) -> None:
        self.port, self.chunk = port, chunk
        self.cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", str(port),
                    "--max-prefill-length", str(chunk), *extra]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        self.log_path = os.path.join(log_dir, f"server-{chunk}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        """Seconds until GET /health answers 200."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready in {timeout} s:\n" + self.log_tail())

    def log_tail(self, n: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, timeout: float = 60) -> str:
        """SIGTERM, then wait; SIGKILL (to this process only) if it does not exit in time."""
        how = "exited before SIGTERM"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
                how = f"SIGTERM, exit code {self.proc.returncode}"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                how = f"killed: still running {timeout} s after SIGTERM"
        self._log.close()
        return how


# ---------------------------------------------------------------- one phase


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks, as numpy's default."""
    if not xs:
        return None
    xs, k = sorted(xs), (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 3)


def run_phase(port: int, kind: str, a: argparse.Namespace, seed: int,
              long_len: int) -> dict[str, Any]:
    """One window of short streams, with or without one long prompt; its figures."""
    clients = Clients(port, a.clients, a.short_prompt_len, a.short_max_tokens, seed, a.timeout)
    load_start = os.getloadavg()
    clients.start()
    time.sleep(a.settle)  # every client past its first prefill, decoding
    t0 = time.perf_counter()
    long: dict[str, Any] | None = None
    resumed = None
    if kind == "with":
        ids = random_ids(random.Random(seed + 7), long_len)
        box: list[dict[str, Any]] = []
        t = threading.Thread(target=lambda: box.append(long_request(port, ids, a.long_timeout)))
        t.start()
        with tqdm(desc="  long prompt", unit="s", leave=False, file=sys.stderr,
                  bar_format="{desc}: {n:.0f} s") as bar:
            while t.is_alive():
                t.join(1.0)
                bar.n = time.perf_counter() - t0
                bar.refresh()
        long = box[0]
        # the window closes once every stream has moved again (a decode step may take longer
        # than --tail on a busy machine), plus --tail
        deadline = time.perf_counter() + a.resume_timeout
        while not clients.all_heard_after(long["end"]) and time.perf_counter() < deadline:
            time.sleep(0.02)
        resumed = clients.all_heard_after(long["end"])
        time.sleep(a.tail)
    else:
        for _ in tqdm(range(int(a.window)), desc="  window", unit="s", leave=False,
                      file=sys.stderr):
            time.sleep(1.0)
        time.sleep(a.window - int(a.window))
    t1 = time.perf_counter()
    clients.stop()
    load_end = os.getloadavg()

    gaps: list[float] = []
    for s in clients.streams:
        gaps += [b - a_ for a_, b in zip(s.chunks, s.chunks[1:]) if t0 <= b <= t1]
    arrivals = sorted(c for s in clients.streams for c in s.chunks if t0 <= c <= t1)
    silences = [b - a_ for a_, b in zip(arrivals, arrivals[1:])]
    sent_in = [s for s in clients.streams if t0 <= s.sent <= t1 and s.chunks]
    ttfts = [s.chunks[0] - s.sent for s in sent_in]
    errors = [s.error for s in clients.streams if s.error]
    # one chunk per token? compare the chunks with text with the usage of finished streams
    whole = [s for s in clients.streams if not s.error and s.usage_tokens]
    return {
        "kind": kind, "seed": seed, "window_s": t1 - t0,
        "loadavg_start": load_start, "loadavg_end": load_end,
        "requests": len(clients.streams), "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "chunks_per_token": (sum(len(s.chunks) for s in whole)
                             / max(1, sum(s.usage_tokens for s in whole))),
        "short_tokens_in_window": len(arrivals),
        "short_tok_s": len(arrivals) / (t1 - t0),
        "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p99": ms(percentile(gaps, 99)),
        "itl_ms_max": ms(max(gaps, default=None)),
        "longest_silence_ms": ms(max(silences, default=None)),
        "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_max": ms(max(ttfts, default=None)),
        "all_streams_resumed": resumed,
        "long": None if long is None else {
            k: v for k, v in long.items() if k not in ("start", "end")},
        "raw": {"itl_ms": [round(1e3 * g, 2) for g in gaps],
                "ttft_ms": [round(1e3 * x, 2) for x in ttfts]},
    }


# ---------------------------------------------------------------- the report


def cpu_info() -> dict[str, Any]:
    """The CPU model and core counts as /proc/cpuinfo and os.cpu_count() give them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []

    def field_(name: str) -> str | None:
        return next((x.split(":", 1)[1].strip() for x in lines if x.startswith(name)), None)

    cores = {(x.split(":", 1)[1].strip()) for x in lines if x.startswith("core id")}
    return {"cpu": field_("model name") or "unknown", "logical_cpus": os.cpu_count(),
            "cores_per_socket": field_("cpu cores"), "distinct_core_ids": len(cores) or None}


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")


METRICS = ("itl_ms_p50", "itl_ms_p99", "itl_ms_max", "longest_silence_ms", "short_tok_s")


def summarize(config: dict[str, Any]) -> dict[str, Any]:
    """Median and range over the repeats of each metric, per phase kind."""
    out: dict[str, Any] = {}
    for kind in ("without", "with"):
        phases = [p for p in config["phases"] if p["kind"] == kind]
        for m in METRICS:
            xs = [p[m] for p in phases if p[m] is not None]
            out[f"{kind}_{m}"] = ([statistics.median(xs), min(xs), max(xs)] if xs else None)
    lat = [p["long"]["latency_s"] for p in config["phases"]
           if p["long"] and p["long"].get("status") == 200]
    out["long_latency_s"] = [statistics.median(lat), min(lat), max(lat)] if lat else None
    return out


def cell(v: list[float] | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    med, lo, hi = v
    if lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def table(configs: list[dict[str, Any]]) -> str:
    cols = [("chunk", None, 0), ("ITL p50 w/o", "without_itl_ms_p50", 0),
            ("ITL p99 w/o", "without_itl_ms_p99", 0), ("ITL max w/o", "without_itl_ms_max", 0),
            ("ITL p50 with", "with_itl_ms_p50", 0), ("ITL p99 with", "with_itl_ms_p99", 0),
            ("ITL max with", "with_itl_ms_max", 0),
            ("silence with", "with_longest_silence_ms", 0),
            ("tok/s w/o", "without_short_tok_s", 1), ("tok/s with", "with_short_tok_s", 1),
            ("long s", "long_latency_s", 1)]
    rows = [[str(c["chunk"])] + [cell(c["summary"][key], d) for _, key, d in cols[1:]]
            for c in configs]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (h, _, _) in enumerate(cols)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows]
    lines.append("ITL and silence in ms; median [min-max] over the repeats; tok/s: the short "
                 "streams' tokens per second in the window; long s: the long prompt's time to "
                 "completion")
    for c in configs:
        loads = c["loadavg"] + [p["loadavg_start"][0] for p in c["phases"]]
        if not loads:
            continue
        errs = sum(p["errors"] for p in c["phases"])
        refused = [p["long"] for p in c["phases"] if p["long"] and p["long"].get("status") != 200]
        note = f"chunk {c['chunk']}: 1-min load average {min(loads):.1f}-{max(loads):.1f}"
        if errs:
            note += f"; {errs} short requests failed"
        if refused:
            note += f"; long prompt failed: {refused[0].get('status')} {refused[0].get('error')}"
        lines.append(note)
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--chunks", type=int, nargs="+", default=[8192, 2048, 512, 256],
                   metavar="N", help="--max-prefill-length values, one server each")
    p.add_argument("--port", type=int, default=19411)
    p.add_argument("--clients", type=int, default=4, help="short streams at once (K)")
    p.add_argument("--short-prompt-len", type=int, default=16, help="token ids per short prompt")
    p.add_argument("--short-max-tokens", type=int, default=48)
    p.add_argument("--long-len", type=int, default=7000, help="token ids in the long prompt")
    p.add_argument("--window", type=float, default=20.0,
                   help="seconds of the phase without the long prompt")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds the clients run before a window opens")
    p.add_argument("--tail", type=float, default=2.0,
                   help="seconds the 'with' window lasts after the long prompt completes")
    p.add_argument("--resume-timeout", type=float, default=60,
                   help="at most this many seconds to wait, after the long prompt completes, "
                   "for every short stream to move again")
    p.add_argument("--repeats", type=int, default=2, help="each phase, per chunk size")
    p.add_argument("--budget-min", type=float, default=25,
                   help="a repeat after the first runs for a chunk size only if it would end "
                   "within this many minutes of the start, judging by that size's first repeat;"
                   " the first repeat always runs in full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="per short request")
    p.add_argument("--long-timeout", type=float, default=600)
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every server (repeatable)")
    p.add_argument("--json", help="results file; default: benchmark/results/DATE-cpu-fairness"
                   ".json (none with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test (< 60 s on an idle machine): one chunk size (512), 2 "
                   "clients, a 600-token long prompt, 4 s window, one repeat")
    a = p.parse_args(argv)
    if a.quick:
        a.chunks, a.clients, a.long_len, a.window, a.settle = [512], 2, 600, 4.0, 1.5
        a.repeats, a.short_max_tokens, a.tail = 1, 16, 0.5
    elif a.json is None:
        a.json = str(ROOT / "benchmark" / "results"
                     / f"{datetime.date.today().isoformat()}-cpu-fairness.json")
    return a


def run_block(a: argparse.Namespace, chunk: int, r: int, kinds: tuple[str, ...], log_dir: str,
              bar: tqdm) -> dict[str, Any]:
    """One server with this chunk size, and one repeat of the two phases on it."""
    run: dict[str, Any] = {"chunk": chunk, "repeat": r, "order": list(kinds),
                           "loadavg_start": os.getloadavg(), "phases": []}
    server = Server(a.model, a.port, chunk, log_dir, a.server_arg)
    try:
        run["ready_s"] = server.wait_ready(a.ready_timeout)
        # warm-up, not timed: one short stream and one 256-token prompt
        warm = random.Random(f"warm {chunk} {r}")
        stream_once(a.port, Stream(-1, 0.0), random_ids(warm, 16), 8, a.timeout)
        long_request(a.port, random_ids(warm, 256), a.timeout)
        for kind in kinds:
            bar.set_postfix_str(f"chunk {chunk}, repeat {r + 1}, {kind}")
            seed = a.seed + 100_000 * r + 10 * chunk + (kind == "with")
            phase = run_phase(a.port, kind, a, seed, a.long_len)
            run["phases"].append(phase)
            bar.update()
            long = phase["long"]
            tqdm.write(f"chunk {chunk:>5} repeat {r + 1} {kind:>7}: ITL p50/p99/max "
                       f"{phase['itl_ms_p50']}/{phase['itl_ms_p99']}/{phase['itl_ms_max']} ms, "
                       f"{phase['short_tok_s']:.1f} tok/s, load {phase['loadavg_start'][0]:.1f}"
                       + ("" if long is None else
                          f", long {long['status']} in {long['latency_s']:.1f} s"),
                       file=sys.stderr)
    except RuntimeError as e:
        run["error"] = str(e)
        tqdm.write(f"chunk {chunk} repeat {r + 1}: {e}", file=sys.stderr)
    finally:
        run["stopped"] = server.stop()
        run["server_log_tail"] = server.log_tail(5)
    run["loadavg_end"] = os.getloadavg()
    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "bench": "fairness", "date": datetime.date.today().isoformat(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": cpu_info(), "commit": git_commit(), "python": sys.version.split()[0],
        "command": shlex.join(["benchmark/fairness.py", *(sys.argv[1:] if argv is None
                                                           else argv)]),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "workload": {k: getattr(a, k) for k in (
            "model", "chunks", "clients", "short_prompt_len", "short_max_tokens", "long_len",
            "window", "settle", "tail", "repeats", "budget_min", "seed", "server_arg")},
        "runs": [], "skipped": []}
    bar = tqdm(total=len(a.chunks) * a.repeats * 2, desc="phases", unit="phase",
               file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fairness-") as log_dir:
        # repeat by repeat, each chunk size in turn on a fresh server: a slow spell of the
        # machine spreads over the sizes instead of falling on one; in each repeat the phases
        # come in the other order (without, with; then with, without)
        took: dict[int, float] = {}  # seconds of each chunk size's first block
        for r in range(a.repeats):
            kinds = ("without", "with") if r % 2 == 0 else ("with", "without")
            for chunk in a.chunks:
                elapsed = time.perf_counter() - started
                if r > 0 and elapsed + took[chunk] > 60 * a.budget_min:
                    report["skipped"].append({"chunk": chunk, "repeat": r})
                    bar.update(2)
                    continue
                report["runs"].append(run_block(a, chunk, r, kinds, log_dir, bar))
                took.setdefault(chunk, time.perf_counter() - started - elapsed)
    bar.close()
    report["duration_s"] = time.perf_counter() - started
    report["configs"] = []
    for chunk in a.chunks:
        runs = [x for x in report["runs"] if x["chunk"] == chunk]
        config = {"chunk": chunk, "phases": [p for x in runs for p in x["phases"]],
                  "loadavg": [x["loadavg_start"][0] for x in runs]
                  + [x["loadavg_end"][0] for x in runs]}
        config["summary"] = summarize(config)
        report["configs"].append(config)
    text = table(report["configs"])
    if report["skipped"]:
        text += "\nskipped (past --budget-min): " + ", ".join(
            f"chunk {x['chunk']} repeat {x['repeat'] + 1}" for x in report["skipped"])
    for x in report["runs"]:
        if x.get("error"):
            text += f"\nchunk {x['chunk']} repeat {x['repeat'] + 1}: {x['error'][:300]}"
    print(text)
    print(f"total {report['duration_s']:.0f} s")
    report["table"] = text.split("\n")
    for config in report["configs"]:  # the phases are kept once, under "runs"
        del config["phases"]
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()
