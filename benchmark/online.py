"""Servers side by side under the same client (chapter 21): each engine's server is started once,
then every load is run on each in turn, round after round, the order of the engines rotating
each round so that drift hits them alike.

    python benchmark/online.py --model /tmp/q06 --engine ours=python \\
        --engine official=/tmp/official/python --rounds 3 --concurrency 1 16 64 256 \\
        --rates 16 40 --out results/

A load is either N requests in flight (a closed loop: a new request as soon as one ends) or a
Poisson rate. Requests are chat completions of random text (`--input-len` tokens of random ids,
decoded), streamed, `--output-len` tokens each with ignore_eos; every engine gets the same list
in a round, and each round draws a new one (so no round finds the last one's prompts cached).
Every server gets the same flags (`--server-args`, `--num-pages`). For each run the report keeps
the client's metrics (bench_serving.py) with every request's TTFT, the client's CPU seconds per
second, and each server process's. When N in flight of a round's mean request shape need more KV
tokens than `--num-pages`, a note says so: only some run at once, the rest wait for memory, and
that round's TTFT measures the wait too.

`--profile N` then runs N in flight once more on each engine while py-spy samples every server
process (native frames too) for `--profile-seconds`, and summarizes where each was busy.
`online.py --print RUN.json` prints a saved run's report again; `online.py --pool RUN.json[:OLD=NEW,
...] ...` pools the rounds of several runs (engines renamed, a run's others dropped) into one
table, with the rounds in which the first engine's TTFT p50 and ITL p99 were the lower.
`--trace` starts the servers with MINISGL_STEP_TRACE (ours only: per-step timings of the
scheduler loop) and summarizes each run's steps. `--step-timer` times every engine's steps
with the same wrappers instead (benchmark/steptimer: a microsecond or so per step, alike on
both sides), and adds when decode tokens left each scheduler (`emit_gap_ms`).
`--launch-profile N` starts ours with MINISGL_LAUNCH_PROFILE: the operators inside its first N
prefill launches under the load, ranked by host time (a diagnostic: the profiler slows the
steps it covers, so the numbers of those rounds are not for comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving as bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("receive", "prepare", "launch", "wait", "reply")  # a step's parts, as StepTrace's
HOPS = ("in", "scheduler", "out")  # a lone request's first token: before, in, after the scheduler


@dataclass
class Engine:
    """One server: its name, the folder its `minisgl` is imported from, its port."""

    name: str
    package: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    trace: Path | None = None
    started_s: float = 0.0
    cpu: dict[int, float] = field(default_factory=dict)

    def pids(self) -> list[int]:
        import psutil

        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]

    def cpu_times(self) -> dict[int, float]:
        import psutil

        out = {}
        for pid in self.pids():
            try:
                t = psutil.Process(pid).cpu_times()
                out[pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return out


def gpu_pids() -> set[int]:
    """Processes that hold GPU memory: the schedulers."""
    if not shutil.which("nvidia-smi"):
        return set()
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return {int(x) for x in out.split() if x.strip().isdigit()}


def start(engine: Engine, model: str, server_args: list[str], out: Path, trace: bool,
          launch_profile: int = 0, step_timer: bool = False) -> None:
    """Launch the server; `wait_ready` waits for it (servers start side by side)."""
    path = [str(engine.package), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if step_timer:  # the same wrappers in either package: benchmark/steptimer/sitecustomize.py
        path.insert(0, str(Path(__file__).parent / "steptimer"))
        engine.trace = out / f"steps-{engine.name}.jsonl"
        env["MINISGL_STEP_TIMER"] = str(engine.trace)
    env["PYTHONPATH"] = ":".join(path)
    if trace and not step_timer:
        engine.trace = out / f"trace-{engine.name}.jsonl"
        env["MINISGL_STEP_TRACE"] = str(engine.trace)
    if launch_profile:
        env["MINISGL_LAUNCH_PROFILE"] = f"{out / f'launch-{engine.name}.json'}:{launch_profile}"
    engine.log = out / f"server-{engine.name}.log"
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", str(engine.port),
           *server_args]
    engine.started_s = time.perf_counter()  # the launch time until wait_ready
    engine.proc = subprocess.Popen(cmd, env=env, stdout=engine.log.open("wb"),
                                   stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(engine: Engine) -> None:
    """Until the server answers a chat request; started_s becomes the seconds that took."""
    assert engine.proc is not None and engine.log is not None
    t0 = engine.started_s
    target = bench.Target(port=engine.port, backend="chat", timeout=60)
    while not (r := bench.one_request(target, "hi", 4)).ok:
        if engine.proc.poll() is not None or time.perf_counter() - t0 > 900:
            tail = engine.log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"server {engine.name} did not come up ({r.error}):\n{tail}")
        time.sleep(1)
    engine.started_s = time.perf_counter() - t0
    print(f"server {engine.name} ready in {engine.started_s:.0f} s", flush=True)


def stop(engine: Engine) -> int | None:
    """SIGTERM to the server's process group; SIGKILL after 30 s. Its exit code (None: killed)."""
    if engine.proc is None or engine.proc.poll() is not None:
        return None if engine.proc is None else engine.proc.returncode
    os.killpg(engine.proc.pid, signal.SIGTERM)
    try:
        return engine.proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        print(f"server {engine.name}: killed after SIGTERM", flush=True)
        return None


def requests_for(load: tuple[str, float], args: argparse.Namespace, tokenizer: Any,
                 seed: int, scale: int = 1) -> list[tuple[list[int] | str, int]]:
    """The load's requests, all distinct (a repeated prompt would be answered by the prefix
    cache, and no prefill would be measured)."""
    kind, value = load
    n = scale * (max(args.min_prompts, int(args.prompts_per_slot * value))
                 if kind == "concurrency" else int(args.rate_seconds * value))
    pairs = bench.workload(n, tuple(args.input_len), tuple(args.output_len), args.vocab, seed)
    return [(tokenizer.decode(ids, skip_special_tokens=True), k) for ids, k in pairs]


def prompt_tokens(requests: list[tuple[list[int] | str, int]], tokenizer: Any) -> list[int]:
    """Each request's prompt as the server sees it: a chat message through the chat template."""
    lens = []
    for prompt, _ in requests:
        if isinstance(prompt, str):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True, tokenize=False)
            lens.append(len(tokenizer(text, add_special_tokens=False).input_ids))
        else:
            lens.append(len(prompt))
    return lens


def pool_note(label: str, in_flight: int, prompts: list[int], outputs: list[int],
              num_pages: int) -> str | None:
    """Why a closed loop's TTFT may measure memory rather than the scheduler: when N requests of
    the load's mean shape need more KV tokens than the pool holds, only about pool / shape run at
    once and the rest wait for one to finish (a whole generation), so its TTFT has two modes
    and their median moves between rounds. None when the pool holds them (or is unknown: 0)."""
    shape = statistics.mean(prompts) + statistics.mean(outputs)
    if not num_pages or in_flight * shape <= num_pages:
        return None
    return (f"{label}: {in_flight} requests of the mean shape ({shape:,.0f} tokens: prompt "
            f"{statistics.mean(prompts):,.0f} + output {statistics.mean(outputs):,.0f}) need "
            f"{in_flight * shape:,.0f} KV tokens and the pool holds {num_pages:,}: about "
            f"{num_pages / shape:.0f} run at once, the others wait for one to end, and TTFT "
            f"measures that wait as well")


def loads_of(a: argparse.Namespace) -> dict[tuple[str, float], str]:
    """The run's loads in order, each with its label: N in flight ("c=N"), then the rates."""
    loads = [("concurrency", float(c)) for c in a.concurrency] + [("rate", r) for r in a.rates]
    return {ld: (f"c={int(ld[1])}" if ld[0] == "concurrency" else f"{ld[1]:g}/s") for ld in loads}


def round_seed(rnd: int, i: int) -> int:
    """The seed of round rnd's i-th load: every engine gets its requests, no other round does."""
    return 1000 * rnd + i


def round_notes(a: argparse.Namespace, tokenizer: Any, rnd: int) -> list[str]:
    """`pool_note` for each N in flight of round rnd, its requests drawn again from the seed."""
    notes = []
    for i, (load, name) in enumerate(loads_of(a).items()):
        if load[0] == "concurrency":
            requests = requests_for(load, a, tokenizer, round_seed(rnd, i))
            note = pool_note(f"{name} r{rnd}", int(load[1]), prompt_tokens(requests, tokenizer),
                             [k for _, k in requests], a.num_pages)
            notes += [note] if note else []
    return notes


def measure(engine: Engine, load: tuple[str, float],
            requests: list[tuple[list[int] | str, int]], seed: int) -> dict[str, Any]:
    """One run of one load on one server: the client's row plus each server process's CPU."""
    kind, value = load
    target = bench.Target(port=engine.port, backend="chat", timeout=600)
    rate, cap = (bench.INF, int(value)) if kind == "concurrency" else (value, 0)
    before, t0 = engine.cpu_times(), time.perf_counter()
    run = bench.run(target, requests, rate, cap, seed, progress=False)
    after, wall = engine.cpu_times(), time.perf_counter() - t0
    row = bench.summarize(rate, run.results, run.duration, run.client_cpu)
    gpu = gpu_pids()
    row["server_cpu"] = {("scheduler" if pid in gpu else "main" if pid == engine.pids()[0]
                          else f"pid{pid}"): round((after[pid] - before.get(pid, 0.0)) / wall, 3)
                         for pid in after}
    row["window"] = [t0, t0 + wall]
    row["ttft_ms"] = [round(r.ttft * 1e3, 1) for r in run.results if r.ok]  # the distribution
    if kind == "concurrency" and value == 1:  # one at a time: each first token can be followed
        row["first_tokens"] = [[r.sent, r.ttft] for r in run.results if r.ok]  # through the hops
    return row


async def _load_in_background(engine: Engine, requests: list[tuple[list[int] | str, int]],
                              concurrency: int, seconds: float, out: Path) -> None:
    target = bench.Target(port=engine.port, backend="chat", timeout=600)
    task = asyncio.create_task(bench.run_async(target, requests, bench.INF, concurrency,
                                               progress=False))
    await asyncio.sleep(3)  # past the first wave's prefills
    procs, gpu = [], gpu_pids()
    for pid in engine.pids():
        raw = out / f"pyspy-{engine.name}-{pid}.txt"
        # native frames (which CUDA or torch call) only for the scheduler: py-spy must pause a
        # process to read them, so that one runs a little slower while it is sampled
        how = ["--native", "--rate", "100"] if pid in gpu else ["--nonblocking", "--rate", "200"]
        procs.append((pid, raw, await asyncio.create_subprocess_exec(
            "py-spy", "record", "--pid", str(pid), *how, "--duration", str(int(seconds)),
            "--format", "raw", "--output", str(raw),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)))
    for _, _, p in procs:
        await p.wait()
    task.cancel()  # the rest of the load is not needed: its clients leave, the server aborts
    try:
        await task
    except asyncio.CancelledError:
        pass
    await asyncio.sleep(2)  # the aborts settle before the next engine's turn


def summarize_pyspy(raw: Path, top: int = 14) -> dict[str, Any]:
    """From py-spy's raw output (one `frame;frame;... count` line per stack): busy samples, the
    frames where they were spent (self), and our package's lines that include the most."""
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    if not raw.exists():
        return {"samples": 0}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        leaf[frames[-1]] += n
        for f in set(frames):
            if "minisgl" in f:
                inclusive[f] += n
    return {"samples": total, "self": leaf.most_common(top),
            "minisgl_inclusive": inclusive.most_common(top)}


def summarize_trace(path: Path, windows: list[tuple[str, float, float]],
                    firsts: dict[str, list[list[float]]] | None = None) -> dict[str, Any]:
    """Each run's steps from the scheduler's trace: how many of each phase, the median ms of
    each part, and the share of the run's time the loop spent waiting for the GPU; for a run in
    `firsts` (one request at a time: its [sent, ttft] pairs) where its first token's time went."""
    if not path.exists():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    out = {}
    for label, a, b in windows:
        steps = [r for r in rows if a <= r["t"] <= b]
        if not steps:
            continue
        s: dict[str, Any] = {"steps": len(steps), "wall_s": b - a}
        for phase in ("prefill", "decode"):
            ph = [r for r in steps if r.get("phase") == phase]
            s[phase] = {"count": len(ph), "size_p50": _med([r["size"] for r in ph]),
                        "tokens_p50": _med([r.get("tokens", 0) for r in ph]),
                        **{p: _med([r[p] for r in ph]) for p in PARTS},
                        "launch_p90": _quantile([r["launch"] for r in ph], 0.9)}
        # one loop turn, start to start: the server's side of the gap between two tokens
        turns = [1e3 * (y["t"] - x["t"]) for x, y in zip(steps, steps[1:])]
        s["turn_ms"] = {"p50": _quantile(turns, 0.5), "p90": _quantile(turns, 0.9),
                        "p99": _quantile(turns, 0.99)}
        # when decode tokens leave the scheduler: the end of each step that handed out a
        # decode batch's tokens; the gaps between them are what a running stream sees first
        emits = [(r["t"] + sum(r[p] for p in PARTS) / 1e3, prev["size"])
                 for prev, r in zip(steps, steps[1:]) if prev.get("phase") == "decode"]
        gaps = [1e3 * (b[0] - a[0]) for a, b in zip(emits, emits[1:])]
        # a client's inter-token gaps count one gap per stream that waited it: weighted by the
        # batch that ends it, one long pause of 256 streams outweighs many short ones
        sizes = [b[1] for b in emits[1:]]
        s["emit_gap_ms"] = {"p50": _quantile(gaps, 0.5), "p99": _quantile(gaps, 0.99),
                            "p99_by_stream": _weighted_quantile(gaps, sizes, 0.99),
                            "max": round(max(gaps), 3) if gaps else None}
        # shares of the run's wall time: waiting for the GPU's tokens, and busy on the host
        # (a receive can be an idle wait for requests, so it is not counted as busy)
        counted = [r["cuda"] for r in steps if "cuda" in r]  # the step timer's, prefill rows
        if len(counted) > 1:  # what the allocator did between the run's first and last prefill
            s["cuda_allocator"] = dict(zip(("retries", "mallocs", "frees"),
                                           (b - a for a, b in zip(counted[0], counted[-1]))))
        if firsts and label in firsts:
            # every row: a lone request's prefill step began (t) before the run, while idle
            s["first_token_ms"] = first_token_hops(rows, firsts[label])
        s["wait_share"] = round(sum(r["wait"] for r in steps) / 1e3 / (b - a), 4)
        s["host_share"] = round(sum(r[p] for r in steps for p in ("prepare", "launch", "reply"))
                                / 1e3 / (b - a), 4)
        out[label] = s
    return out


def first_token_hops(steps: list[dict[str, Any]], firsts: list[list[float]]
                     ) -> dict[str, float | int | None]:
    """A lone request's time to first token in three hops, medians in ms: `in` from the client's
    send to the scheduler's loop picking it up (API server, tokenizer, sockets), `scheduler` from
    there to its first token leaving the scheduler (prepare, prefill, the next step's launch and
    the wait: an overlap loop hands a batch's tokens out in the step after it), and `out` from
    there to the client reading it (detokenizer, API server, HTTP). Both ends read the host's
    one perf_counter clock. A request is matched with the first prefill step whose pickup falls
    inside its wait for the first token. The token leaves during the step that hands it out:
    at `early` where that step handed it out before its launch, else that step's end stands for
    it (`out` is then short by the rest of that step, and on a fast path it can come out below
    zero)."""
    picked = [(r["t"] + r["receive"] / 1e3, _handed_out(r2))
              for r, r2 in zip(steps, steps[1:]) if r.get("phase") == "prefill"]
    each: list[list[float] | None] = []  # per request, in the order sent: in, scheduler, out
    for sent, ttft in firsts:
        got = next(((p, e) for p, e in picked if sent <= p <= sent + ttft), None)
        spans = (None if got is None
                 else (got[0] - sent, got[1] - got[0], sent + ttft - got[1]))
        each.append(None if spans is None else [round(1e3 * x, 4) for x in spans])
    kept = [x for x in each if x is not None]
    return {"matched": len(kept), "of": len(firsts),
            **{k: _med([x[i] for x in kept]) for i, k in enumerate(HOPS)}, "each": each}


def _handed_out(step: dict[str, Any]) -> float:
    """When a step handed out the previous batch's tokens: `early` says so where it did that
    before its launch, else its end stands for it."""
    if step.get("early"):
        return step["t"] + step["early"] / 1e3
    return step["t"] + sum(step[p] for p in PARTS) / 1e3


def paired_hops(traces: dict[str, Any], engines: list[str]) -> list[str]:
    """Lone requests compared one by one: in a round every engine gets the same prompts in the
    same order, so request i's hops on an engine minus its hops on the first engine take the
    prompt out of the difference. Per run: the median difference (and its p10..p90) of the
    time to first token and of each hop, over the requests matched on both."""
    base, lines = engines[0], []
    for name in engines[1:]:
        for run, s in traces.get(name, {}).items():
            mine, theirs = (s.get("first_token_ms"),
                            traces.get(base, {}).get(run, {}).get("first_token_ms"))
            if not mine or not theirs:
                continue
            pairs = [(x, y) for x, y in zip(mine["each"], theirs["each"]) if x and y]
            if not pairs:
                continue
            cols = []
            for i, hop in enumerate((*HOPS, "total")):
                d = sorted((sum(x) - sum(y)) if hop == "total" else (x[i] - y[i])
                           for x, y in pairs)
                lo, hi = d[int(0.1 * (len(d) - 1))], d[int(0.9 * (len(d) - 1))]
                cols.append(f"{hop} {statistics.median(d):+.2f} ({lo:+.2f}..{hi:+.2f})")
            lines.append(f"first token {run}, {name} − {base}, ms per request ({len(pairs)}): "
                         + ", ".join(cols))
    return lines


def _quantile(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def _weighted_quantile(xs: list[float], weights: list[int], q: float) -> float | None:
    """The q-quantile of xs with each x counted weights[i] times."""
    pairs = sorted(zip(xs, weights))
    total, seen = sum(weights), 0
    for x, w in pairs:
        seen += w
        if seen > q * total:
            return round(x, 3)
    return round(pairs[-1][0], 3) if pairs else None


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def spread(xs: list[float]) -> str:
    return (f"{statistics.median(xs):,.0f} ({min(xs):,.0f}–{max(xs):,.0f})" if len(xs) > 1
            else f"{xs[0]:,.0f}")


def report(rows: list[dict[str, Any]], engines: list[str], loads: list[str]) -> list[str]:
    """Per load: each engine's median output tok/s (range over rounds), TTFT p50 and ITL p99
    medians, and the ratio of each engine to the first, per round (median and range)."""
    base = engines[0]
    lines = [f"{'load':>10} {'engine':>10} {'out tok/s (range)':>26} {'TTFT p50':>9} "
             f"{'ITL p99':>8} {'client':>6}  ratio to {base} per round"]
    for load in loads:
        for e in engines:
            mine = [r for r in rows if r["load"] == load and r["engine"] == e]
            if not mine:
                continue
            tok = [r["out_tok_s"] for r in mine]
            ratios = []
            for r in mine:
                other = [b for b in rows if b["load"] == load and b["engine"] == base
                         and b["round"] == r["round"]]
                if other and e != base:
                    ratios.append(r["out_tok_s"] / other[0]["out_tok_s"])
            ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"
                     if ratios else "")
            lines.append(f"{load:>10} {e:>10} {spread(tok):>26} "
                         f"{statistics.median(r['ttft_ms_p50'] for r in mine):>9.1f} "
                         f"{statistics.median(r['itl_ms_p99'] for r in mine):>8.1f} "
                         f"{max(r['client_cpu'] for r in mine):>6.2f}  {ratio}")
    return lines


def pooled(runs: list[tuple[dict[str, Any], dict[str, str]]]) -> list[str]:
    """The rounds of several runs as one: each run's engines renamed (OLD -> NEW; when a run is
    given names, its other engines are dropped; the first run's order of names is the report's,
    its first name the base), its rounds kept apart by the run's index. Per
    load and engine: the report's columns, then in how many rounds the first engine's TTFT p50
    and ITL p99 were lower than this one's (ties count as lower)."""
    rows = []
    for i, (result, names) in enumerate(runs):
        for r in result["rows"]:
            name = names.get(r["engine"], None if names else r["engine"])
            if name is not None:
                rows.append({**r, "engine": name, "round": (i, r["round"])})
    # the first run's names in the order given (the first is the base), then any others
    engines = list(dict.fromkeys([*runs[0][1].values(), *(r["engine"] for r in rows)]))
    loads = list(dict.fromkeys(r["load"] for r in rows))
    base = {(r["load"], r["round"]): r for r in rows if r["engine"] == engines[0]}
    lines = report(rows, engines, loads)
    lines[0] += f"   rounds {engines[0]} lower: TTFT p50, ITL p99"
    for k, line in enumerate(lines[1:], 1):
        load, engine = line.split()[:2]
        if engine == engines[0]:
            continue
        pairs = [(base[(load, r["round"])], r) for r in rows
                 if r["engine"] == engine and r["load"] == load and (load, r["round"]) in base]
        ttft = sum(b["ttft_ms_p50"] <= r["ttft_ms_p50"] for b, r in pairs)
        itl = sum(b["itl_ms_p99"] <= r["itl_ms_p99"] for b, r in pairs)
        lines[k] += f"   {ttft}/{len(pairs)}, {itl}/{len(pairs)}"
    return lines


def print_report(result: dict[str, Any]) -> None:
    """The table, then each run's step summary and each process's profile, as JSON keeps them."""
    print("\n".join(result["table"]))
    for note in result.get("pool_notes", []):
        print(f"note: {note}")
    for name, t in result["traces"].items():
        for run_label, s in t.items():
            if "first_token_ms" in s:  # its per-request lists are for paired_hops, in the JSON
                s = {**s, "first_token_ms": {k: v for k, v in s["first_token_ms"].items()
                                             if k != "each"}}
            print(f"trace {name} {run_label}: {json.dumps(s)}")
    for line in result.get("first_token_pairs", []):
        print(line)
    for name, procs in result["profiles"].items():
        for proc, s in procs.items():
            print(f"py-spy {name} {proc}: {s['samples']} busy samples")
            for frame, n in s.get("self", [])[:10]:
                print(f"    {n:>6}  {frame[:150]}")
            for frame, n in s.get("minisgl_inclusive", [])[:8]:
                print(f"    incl {n:>6}  {frame[:150]}")
    for name, prof in result.get("launch_profiles", {}).items():
        print(f"launch profile {name}: {prof['launches']} prefill launches, "
              f"{prof['launch_ms']:.1f} ms in all; ops by host time:")
        for op, ms, calls in prof["ops"][:20]:
            print(f"    {ms:9.2f} ms {calls:6d} calls  {op}")


def print_notes(result: dict[str, Any], model: str) -> None:
    """A saved run's pool notes, its requests drawn again from its command and seeds (for runs
    made before the notes were kept), with each engine's TTFT and decode batch size beside them."""
    from transformers import AutoTokenizer

    a = parse_args(result["command"].split()[1:])
    tokenizer = AutoTokenizer.from_pretrained(model)
    for rnd in sorted({r["round"] for r in result["rows"]}):
        for note in round_notes(a, tokenizer, rnd):
            run = note.split(":")[0]
            sizes = {name: t[run]["decode"]["size_p50"] for name, t in result["traces"].items()
                     if run in t}
            ttft = {r["engine"]: f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}"
                    for r in result["rows"] if f"{r['load']} r{r['round']}" == run}
            print(f"{note}. TTFT p50 / p99 ms {ttft}" + (f"; decode batch p50 {sizes}"
                                                         if sizes else ""))


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", action="append", required=True, metavar="NAME=PYTHON_DIR",
                   help="a server to run: its name and the folder its minisgl is imported from; "
                   "the first is the one the others are compared with")
    p.add_argument("--server-args", default="--attn fi --cuda-graph-max-bs 256 "
                   "--max-running-requests 256 --max-prefill-length 8192 --page-size 1 "
                   "--max-seq-len-override 4096", help="flags every server gets")
    p.add_argument("--engine-args", action="append", default=[], metavar="NAME=FLAGS",
                   help="flags for one engine only, after --server-args (an engine may be "
                   "named twice, with a different name, to compare a flag)")
    p.add_argument("--num-pages", type=int, default=450000,
                   help="every server's KV pool in tokens (0: each server's own choice); two "
                   "pools of 450000 at the Qwen3-0.6B shape take about 103 GB of one GPU")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256])
    p.add_argument("--rates", type=float, nargs="*", default=[16.0, 40.0])
    p.add_argument("--prompts-per-slot", type=float, default=3.0,
                   help="N in flight sends max(--min-prompts, this × N) requests")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--rate-seconds", type=float, default=12.0,
                   help="a Poisson rate sends rate × this many requests")
    p.add_argument("--input-len", type=int, nargs=2, default=[200, 1000])
    p.add_argument("--output-len", type=int, nargs=2, default=[256, 256])
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--profile", type=int, default=0, help="N in flight under py-spy (0: none)")
    p.add_argument("--profile-seconds", type=float, default=6.0)
    p.add_argument("--trace", action="store_true", help="MINISGL_STEP_TRACE on (ours only)")
    p.add_argument("--step-timer", action="store_true",
                   help="time every engine's steps with the same wrappers (benchmark/steptimer)")
    p.add_argument("--launch-profile", type=int, default=0, metavar="N",
                   help="profile the ops of ours's first N prefill launches (0: off)")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds after which no new round starts (0: none); the rounds done "
                   "are reported as usual")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--base-port", type=int, default=19190)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--print":
        return print_report(json.loads(Path(sys.argv[2]).read_text()))  # a saved run's report
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--notes":
        return print_notes(json.loads(Path(sys.argv[2]).read_text()), sys.argv[3])
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--pool":
        runs = []
        for spec in sys.argv[2:]:
            path, _, renames = spec.partition(":")
            names = dict(x.split("=", 1) for x in renames.split(",") if x)
            runs.append((json.loads(Path(path).read_text()), names))
        return print("\n".join(pooled(runs)))
    a = parse_args(argv)
    began = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    # ports 10 apart: the official's torch.distributed store listens on its HTTP port + 1
    engines = [Engine(name, Path(path).resolve(), a.base_port + 10 * i)
               for i, (name, _, path) in enumerate(e.partition("=") for e in a.engine)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    label = loads_of(a)
    loads = list(label)
    rows: list[dict[str, Any]] = []
    windows: dict[str, list[tuple[str, float, float]]] = {e.name: [] for e in engines}
    profiles: dict[str, Any] = {}
    notes: list[str] = []
    try:
        own = dict(x.partition("=")[::2] for x in a.engine_args)
        if unknown := set(own) - {e.name for e in engines}:
            raise SystemExit(f"--engine-args names no --engine: {sorted(unknown)}")
        for e in engines:
            pool = ["--num-pages", str(a.num_pages)] if a.num_pages else []
            start(e, a.model, a.server_args.split() + pool + own.get(e.name, "").split(), a.out,
                  a.trace, a.launch_profile, a.step_timer)
        for e in engines:
            wait_ready(e)
        for rnd in range(a.rounds):
            order = engines[rnd % len(engines):] + engines[: rnd % len(engines)]
            if a.deadline and time.perf_counter() - began > a.deadline:
                print(f"deadline: stopped before round {rnd}", flush=True)
                break
            for note in round_notes(a, tokenizer, rnd):
                notes.append(note)
                print(f"note: {note}", flush=True)
            for i, load in enumerate(loads):
                seed = round_seed(rnd, i)
                requests = requests_for(load, a, tokenizer, seed)
                for e in order:
                    row = measure(e, load, requests, seed)
                    row.update(engine=e.name, round=rnd, load=label[load])
                    rows.append(row)
                    windows[e.name].append((f"{label[load]} r{rnd}", *row.pop("window")))
                    (a.out / "rows.json").write_text(json.dumps(rows, indent=1))  # so far
                    print(f"round {rnd} {label[load]:>6} {e.name:>10}: {row['out_tok_s']:>9,.0f} "
                          f"out tok/s, TTFT p50 {row['ttft_ms_p50']:.1f} ms, ITL p99 "
                          f"{row['itl_ms_p99']:.1f} ms, failed {row['failed']}, client "
                          f"{row['client_cpu']:.2f}, server {row['server_cpu']}", flush=True)
        if a.profile:
            load = ("concurrency", float(a.profile))
            requests = requests_for(load, a, tokenizer, 99, scale=20)  # more than needed
            for e in engines:
                asyncio.run(_load_in_background(e, requests, a.profile, a.profile_seconds,
                                                a.out))
                gpu = gpu_pids()
                profiles[e.name] = {("scheduler" if pid in gpu else str(pid)):
                                    summarize_pyspy(a.out / f"pyspy-{e.name}-{pid}.txt")
                                    for pid in e.pids()}
    finally:
        codes = {e.name: stop(e) for e in engines}
    for e in engines:  # the step timer writes one file per process that ran a scheduler
        if e.trace is not None and (parts := sorted(a.out.glob(f"{e.trace.name}.*"))):
            e.trace.write_text("".join(f.read_text() for f in parts))
    firsts = {(r["engine"], f"{r['load']} r{r['round']}"): r.pop("first_tokens")
              for r in rows if "first_tokens" in r}
    traces = {e.name: summarize_trace(e.trace, windows[e.name],
                                      {run: v for (name, run), v in firsts.items()
                                       if name == e.name})
              for e in engines if e.trace}
    launches = {e.name: json.loads(f.read_text()) for e in engines
                if (f := a.out / f"launch-{e.name}.json").is_file()}
    text = report(rows, [e.name for e in engines], [label[ld] for ld in loads])
    result = {"bench": "online", "date": datetime.date.today().isoformat(),
              "machine": bench.machine(),
              "command": " ".join(["benchmark/online.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "engines": {e.name: {"package": relative(e.package), "started_s": e.started_s,
                                   "exit_code": codes[e.name]} for e in engines},
              "rows": rows, "pool_notes": notes, "windows": windows, "traces": traces,
              "profiles": profiles, "launch_profiles": launches,
              "first_token_pairs": paired_hops(traces, [e.name for e in engines]),
              "table": text}
    print_report(result)
    (a.out / "online.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
