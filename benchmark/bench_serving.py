"""A serving benchmark against a running OpenAI-compatible server (chapter 21): requests of random
token ids sent to /v1/completions, streamed, at Poisson arrivals (--request-rate) or with a cap on
requests in flight (--max-concurrency); the metrics as SGLang's bench_serving defines them.

    python -m minisgl --model models/SmolLM2-135M-Instruct --port 1919 &
    python benchmark/bench_serving.py --port 1919 --num-prompts 16 --request-rate 2

TTFT: from sending the request to the first chunk with text. ITL: the gaps between chunks with
text. E2E: from sending to the last event. TPOT: (E2E - TTFT) / (output tokens - 1), per request.
Output tokens come from the server's `usage` (stream_options.include_usage), never from what was
asked. Throughputs divide by the time from the first send to the last reply.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


def workload(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
             seed: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens) pairs, lengths uniform in the ranges (inclusive)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*input_range))]
               for _ in range(n)]
    return [(p, rng.randint(*output_range)) for p in prompts]


def one_request(host: str, port: int, prompt: list[int], max_tokens: int,
                timeout: float) -> Result:
    """One streamed /v1/completions request, timed chunk by chunk."""
    body = json.dumps({"model": "any", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    result, last = Result(), 0.0
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return result
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event, now = json.loads(line[6:]), time.perf_counter()
            if any(c.get("text") for c in event.get("choices", [])):
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
                result.prompt_tokens = event["usage"]["prompt_tokens"]
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        result.error = "" if result.ok else "no usage in the stream"
    except OSError as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return result


def run(args: argparse.Namespace, requests: list[tuple[list[int], int]]
        ) -> tuple[list[Result], float]:
    """Sends the requests at their arrival times (Poisson at args.request_rate, all at once if
    inf), at most args.max_concurrency in flight; returns the results and the duration."""
    rng = random.Random(args.seed + 1)
    results = [Result() for _ in requests]
    slots = threading.BoundedSemaphore(args.max_concurrency or len(requests))

    def send(i: int) -> None:
        try:
            prompt, max_tokens = requests[i]
            results[i] = one_request(args.host, args.port, prompt, max_tokens, args.timeout)
        finally:
            slots.release()

    threads, start, due = [], time.perf_counter(), 0.0
    for i in range(len(requests)):
        if args.request_rate != float("inf"):
            due += rng.expovariate(args.request_rate)
            time.sleep(max(0.0, start + due - time.perf_counter()))
        slots.acquire()
        threads.append(threading.Thread(target=send, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks, as numpy's default."""
    if not xs:
        return float("nan")
    xs, k = sorted(xs), (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def report(results: list[Result], duration: float) -> list[str]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    series = {"TTFT": [r.ttft for r in done], "ITL": [x for r in done for x in r.itl],
              "TPOT": tpot, "E2E": [r.e2e for r in done]}
    lines = [f"requests: {len(done)} ok, {len(results) - len(done)} failed; duration "
             f"{duration:.2f} s",
             f"request throughput {len(done) / duration:.2f} req/s; output {out_tokens} tokens "
             f"(from usage), {out_tokens / duration:.1f} tok/s; input "
             f"{sum(r.prompt_tokens for r in done)} tokens"]
    for name, xs in series.items():
        lines.append(f"{name:<5} ms: mean {1e3 * statistics.fmean(xs) if xs else float('nan'):8.1f}"
                     f"  p50 {1e3 * percentile(xs, 50):8.1f}  p99 {1e3 * percentile(xs, 99):8.1f}")
    errors = sorted({r.error for r in results if not r.ok})
    return lines + [f"error: {e}" for e in errors[:5]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1919)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=0, help="0: no cap")
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN",
                                                                                     "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[100, 1024],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--vocab", type=int, default=10000, help="prompt ids are drawn below it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    requests = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                        args.vocab, args.seed)
    results, duration = run(args, requests)
    print(f"bench_serving: {args.num_prompts} requests, rate {args.request_rate}, max "
          f"concurrency {args.max_concurrency or 'none'}, input {args.input_len}, output "
          f"{args.output_len}, seed {args.seed}")
    print("\n".join(report(results, duration)))


if __name__ == "__main__":
    main()
