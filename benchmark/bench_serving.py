"""A serving benchmark: a client that times a running OpenAI-compatible server (chapter 21
introduces it). Prompts of random token ids go to /v1/completions (or, with --backend chat, their
text to /v1/chat/completions), streamed, at Poisson arrivals or all at once, for each rate of
--request-rates in turn after one warm-up request; the metrics as SGLang's bench_serving defines
them, one row per rate. Every request runs on one asyncio event loop over plain HTTP/1.1
connections; each row also gives the client's own CPU seconds per second (near 1.0, the client
would be the bottleneck and its timestamps late).

    python -m minisgl --model models/SmolLM2-135M-Instruct --port 1919 &
    python benchmark/bench_serving.py --port 1919 --num-prompts 16 --request-rates 2 inf
    python benchmark/bench_serving.py --port 1919 --backend chat \\
        --tokenizer models/SmolLM2-135M-Instruct --request-rates 4 --json serving.json

TTFT: from just before the POST to the first chunk with text. ITL: the gaps between chunks with
text (a role-only, empty or usage-only chunk has none). E2E: from before the POST to the last
event. TPOT: (E2E - TTFT) / (output tokens - 1), per request of more than one token. Output
tokens come from the server's `usage` (stream_options.include_usage) when it sends one, else they
are the max_tokens asked for, which is right only because every request sets ignore_eos (the
official mini-sglang server sends no usage); the report says which. Throughputs divide by the time
from the first send to the last reply.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SOURCES = {"usage": "output tokens from usage",
           "requested": "output tokens as requested: the server sent no usage; valid only with "
                        "ignore_eos",
           "mixed": "output tokens from usage for some requests, as requested for others"}
INF = float("inf")


@dataclass(frozen=True)
class Target:
    """Where the requests go and how."""

    host: str = "127.0.0.1"
    port: int = 1919
    backend: str = "completions"  # a key of ENDPOINTS
    timeout: float = 600.0


@dataclass
class Result:
    """One request, timed. output_tokens is from `usage` if from_usage, else as requested;
    `sent` is when it was sent (time.perf_counter, the clock every process on the host shares)."""

    ok: bool = False
    error: str = ""
    sent: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    from_usage: bool = False


def workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
             seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens) pairs, lengths uniform in the ranges (inclusive), ids in
    [10, vocab)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*input_range))]
               for _ in range(n)]
    return [(p, rng.randint(*output_range)) for p in prompts]


def request_body(backend: str, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "any", "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if backend == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def chunk_text(backend: str, event: dict[str, Any]) -> str:
    """The new text of one streamed chunk ("" for role-only, finish and usage chunks)."""
    choices = event.get("choices") or [{}]
    if backend == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _post_stream(target: Target, body: bytes) -> tuple[int, asyncio.StreamReader,
                                                               asyncio.StreamWriter, bool]:
    """POSTs the body over a fresh HTTP/1.1 connection; returns the status, the open stream (at
    the start of the body) and whether the body is chunked."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    head = (f"POST {ENDPOINTS[target.backend]} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    writer.write(head.encode() + body)
    status = int((await reader.readline()).split()[1])
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    return status, reader, writer, chunked


async def _lines(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body's lines as they arrive, through HTTP/1.1 chunked framing if there is one."""
    if not chunked:
        while line := await reader.readline():
            yield line
        return
    pending = b""
    while size := int((await reader.readline()).split(b";")[0], 16):
        pending += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        *done, pending = pending.split(b"\n")
        for line in done:
            yield line
    if pending:
        yield pending


async def one_request_async(target: Target, prompt: list[int] | str, max_tokens: int) -> Result:
    """One streamed request, timed event by event as the events arrive."""
    body = json.dumps(request_body(target.backend, prompt, max_tokens)).encode()
    result, last, done = Result(), 0.0, False
    writer = None
    start = result.sent = time.perf_counter()
    try:
        async with asyncio.timeout(target.timeout):
            status, reader, writer, chunked = await _post_stream(target, body)
            if status != 200:
                result.error = f"HTTP {status}: {(await reader.read(200))!r}"
                return result
            async for raw in _lines(reader, chunked):
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data, now = line[5:].strip(), time.perf_counter()
                result.e2e = now - start
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {json.dumps(event['error'])[:200]}"
                    return result
                if chunk_text(target.backend, event):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.from_usage = True
        if not done:
            result.error = "the stream ended without [DONE]"
        elif result.ttft == 0.0:
            result.error = "no chunk with text"
        else:
            result.ok = True
            if not result.from_usage:
                result.output_tokens = max_tokens  # right only because ignore_eos is sent
    except (OSError, ValueError, IndexError, TimeoutError, asyncio.IncompleteReadError) as e:
        result.error = f"{type(e).__name__}: {e}"  # ValueError: a chunk that is not JSON
    finally:
        if writer is not None:
            writer.close()
    return result


def one_request(target: Target, prompt: list[int] | str, max_tokens: int) -> Result:
    return asyncio.run(one_request_async(target, prompt, max_tokens))


@dataclass
class Run:
    """One rate's requests: their results, the time from the first send to the last reply, and
    the client's own CPU time over it (a client near 1 CPU-second per second cannot keep up,
    and its timestamps come late)."""

    results: list[Result]
    duration: float
    client_cpu: float


async def run_async(target: Target, requests: list[tuple[list[int] | str, int]], rate: float,
                    max_concurrency: int = 0, seed: int = 0, progress: bool = True) -> Run:
    """Sends the requests at their arrival times (Poisson at `rate` per second, all at once if
    inf), at most max_concurrency in flight (0: no cap), all from one event loop."""
    rng = random.Random(seed + 1)
    slots = asyncio.Semaphore(max_concurrency or len(requests))
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", unit="req", file=sys.stderr,
               disable=not progress, leave=False)

    async def send(i: int) -> Result:
        try:
            return await one_request_async(target, *requests[i])
        finally:
            slots.release()
            bar.update()

    tasks, cpu, start, due = [], time.process_time(), time.perf_counter(), 0.0
    for i in range(len(requests)):
        if rate != INF:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + due - time.perf_counter()))
        await slots.acquire()
        tasks.append(asyncio.create_task(send(i)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    bar.close()
    return Run(results, duration, (time.process_time() - cpu) / duration)


def run(target: Target, requests: list[tuple[list[int] | str, int]], rate: float,
        max_concurrency: int = 0, seed: int = 0, progress: bool = True) -> Run:
    return asyncio.run(run_async(target, requests, rate, max_concurrency, seed, progress))


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks, as numpy's default."""
    if not xs:
        return float("nan")
    xs, k = sorted(xs), (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tpot(r: Result) -> float | None:
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def summarize(rate: float, results: list[Result], duration: float,
              client_cpu: float | None = None) -> dict[str, Any]:
    """One row of the report: counts, throughputs, p50/p99 of each latency in ms, and the
    client's CPU seconds per second when known."""
    done = [r for r in results if r.ok]
    by_usage = sum(r.from_usage for r in done)
    row: dict[str, Any] = {
        "rate": "inf" if rate == INF else rate, "completed": len(done),
        "failed": len(results) - len(done), "duration_s": duration,
        "req_s": len(done) / duration, "out_tok_s": sum(r.output_tokens for r in done) / duration,
        "output_len_source": ("usage" if done and by_usage == len(done)
                              else "requested" if by_usage == 0 else "mixed")}
    series = {"ttft": [r.ttft for r in done], "itl": [x for r in done for x in r.itl],
              "tpot": [t for r in done if (t := tpot(r)) is not None],
              "e2e": [r.e2e for r in done]}
    for name, xs in series.items():
        for q in (50, 99):
            row[f"{name}_ms_p{q}"] = 1e3 * percentile(xs, q)
    if client_cpu is not None:
        row["client_cpu"] = client_cpu
    errors = [r.error for r in results if not r.ok]
    if errors:
        row["first_error"] = errors[0]
    return row


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as text: one line per rate, then each failure's first error and the source of
    the output lengths."""
    head = (f"{'rate':>6} {'done':>5} {'fail':>4} {'dur s':>7} {'req/s':>7} {'tok/s':>8}"
            + "".join(f" {n + ' p50':>9} {n + ' p99':>9}" for n in ("TTFT", "ITL", "TPOT", "E2E")))
    lines = [head + " client   (latencies in ms; client: its CPU s/s)"]
    for r in rows:
        cpu = r.get("client_cpu")
        lines.append(f"{r['rate']:>6} {r['completed']:>5} {r['failed']:>4} {r['duration_s']:>7.2f}"
                     f" {r['req_s']:>7.2f} {r['out_tok_s']:>8.1f}"
                     + "".join(f" {r[f'{n}_ms_p50']:>9.1f} {r[f'{n}_ms_p99']:>9.1f}"
                               for n in ("ttft", "itl", "tpot", "e2e"))
                     + (f" {cpu:>6.2f}" if cpu is not None else f" {'-':>6}"))
    for r in rows:
        if r["failed"]:
            lines.append(f"rate {r['rate']}: {r['failed']} failed; first error: {r['first_error']}")
    for source in sorted({r["output_len_source"] for r in rows}):
        rates = ", ".join(str(r["rate"]) for r in rows if r["output_len_source"] == source)
        lines.append(f"{SOURCES[source]} (rates {rates})")
    return lines


def machine() -> str:
    """This machine: its GPUs if nvidia-smi names some, else its CPU model and logical CPUs."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.split("\n")
        gpus = [g.strip() for g in out if g.strip()]
        if gpus:
            return f"{len(gpus)} x {gpus[0]}" if len(gpus) > 1 else gpus[0]
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs"


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 or inf, not {text}")
    return rate


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1919)
    p.add_argument("--backend", choices=list(ENDPOINTS), default="completions",
                   help="completions: token ids to /v1/completions; chat: their text (needs "
                   "--tokenizer) to /v1/chat/completions")
    p.add_argument("--tokenizer", help="a Hugging Face folder whose tokenizer turns ids into text")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rates", "--request-rate", type=parse_rate, nargs="+",
                   default=[INF], metavar="RATE",
                   help="requests per second, Poisson arrivals; inf sends all at once; each "
                   "rate is one run, one after another")
    p.add_argument("--max-concurrency", type=int, default=0, help="0: no cap")
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024],
                   metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024],
                   metavar=("MIN", "MAX"))
    p.add_argument("--vocab", type=int, default=10000, help="prompt ids are drawn below it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--ready-timeout", type=float, default=600,
                   help="seconds to retry the warm-up while the server starts (refused, 503)")
    p.add_argument("--json", help="write the report to this file")
    p.add_argument("--label", default="ours", help="the server's name in the JSON report")
    p.add_argument("--machine", help="the server's machine in the JSON report; default: this one")
    a = p.parse_args(argv)
    if a.backend == "chat" and not a.tokenizer:
        p.error("--backend chat needs --tokenizer, to turn the prompt ids into text")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the table, writes --json; returns the report."""
    a = parse_args(argv)
    target = Target(a.host, a.port, a.backend, a.timeout)
    pairs = workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), a.vocab, a.seed)
    requests: list[tuple[list[int] | str, int]] = list(pairs)
    if a.backend == "chat":  # as SGLang's random prompts: the ids' text, which re-tokenizes
        from transformers import AutoTokenizer  # to about as many tokens, plus the template's

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
        requests = [(tok.decode(ids, skip_special_tokens=True), n) for ids, n in pairs]
    deadline = time.perf_counter() + a.ready_timeout
    while not (warm := one_request(target, requests[0][0][:8], 4)).ok:
        # a server starting up refuses connections, then answers 503 until its engine is ready
        starting = "HTTP 503" in warm.error or "ConnectionRefusedError" in warm.error
        if not starting or time.perf_counter() > deadline:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        time.sleep(1)
    print(f"bench_serving: {a.backend} backend, {a.num_prompts} requests, max concurrency "
          f"{a.max_concurrency or 'none'}, input {a.input_len}, output {a.output_len}, "
          f"vocab {a.vocab}, seed {a.seed}", flush=True)
    runs = [run(target, requests, rate, a.max_concurrency, a.seed) for rate in a.request_rates]
    rows = [summarize(rate, r.results, r.duration, r.client_cpu)
            for rate, r in zip(a.request_rates, runs)]
    print("\n".join(table(rows)))
    report = {
        "bench": "serving", "machine": a.machine or machine(),
        "date": datetime.date.today().isoformat(),
        "versions": {"python": platform.python_version(), "bench": "benchmark/bench_serving.py"},
        "command": shlex.join(sys.argv if argv is None else ["benchmark/bench_serving.py", *argv]),
        "server": a.label,
        "workload": {"num_prompts": a.num_prompts, "input_len": a.input_len,
                     "output_len": a.output_len, "vocab": a.vocab, "seed": a.seed,
                     "backend": a.backend, "max_concurrency": a.max_concurrency},
        "rows": [{k: (None if isinstance(v, float) and math.isnan(v) else v)
                  for k, v in r.items()} for r in rows]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return report


if __name__ == "__main__":
    main()
