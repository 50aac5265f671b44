"""Offline throughput on nano-vllm's workload, ours against the official and HF (chapter 21).

    python benchmark/bench_offline.py --model models/SmolLM2-135M-Instruct --requests 8 \\
        --input-len 16 64 --output-len 8 32 --group ours:torch:eager:on ours:torch:eager:off

The workload is nano-vllm's `bench.py`, which the official `benchmark/offline/bench.py` copies:
random.seed(0), every prompt drawn first (ids in 0..10000, length uniform in --input-len), then
every max_tokens (uniform in --output-len); temperature 0.6 and ignore_eos. With the defaults
(256 requests, 100..1024 both) it asks for 133,966 output tokens.

A configuration is ENGINE:ATTN:GRAPH:OVERLAP, e.g. `ours:fi:graph:on`, `official:fi:graph:on`,
`ours:torch:eager:off`, or `hf` (transformers' continuous batching). Each runs in its own worker
process: ours imports `minisgl` from python/, the official from --official (its python/ folder),
never both in one process. The workers of one --group live at the same time and take their
timed runs in turns (the order rotates each round), so drift hits them alike; the KV pool of
every minisgl worker is sized to hold the whole workload, the same for both engines.

`--eos` (chapter 22) asks for greedy requests that stop at the model's EOS instead (a model
folder made by benchmark/eos_model.py, whose EOS token random weights do emit), so max_tokens is
an upper bound, as a client sets it; a fifth field picks our admission rule,
`ours:fi:graph:on:conservative` (the default is chapter 22's `expected`); `--pool` sets every
engine's KV pool (tokens), small enough that the rule matters.

Each row: median seconds of the timed runs, output tokens counted from the outputs, output
tok/s, the median gap between two result hand-offs of the scheduler (one per step: the decode
step, since decode steps far outnumber prefills), peak memory allocated by torch, start-up time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TAG = "@@bench "  # a worker's lines for the driver start with it; everything else is its log


def workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int],
             max_id: int = 10000, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draws, in its order: all prompts first (ids in 0..max_id), then all output
    lengths."""
    random.seed(seed)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(*input_len))]
               for _ in range(n)]
    return prompts, [random.randint(*output_len) for _ in range(n)]


def shaped(parts: list[tuple[int, tuple[int, int], tuple[int, int], tuple[int, int]]],
           scale: float = 1.0, max_id: int = 10000,
           seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Requests in parts of (count, shared prefixes, prompt range, output range), shuffled
    together: a part with k > 0 shared prefixes (lengths drawn from `prefix_len`) puts one of
    them, drawn per request, before each prompt. `scale` shrinks counts and lengths alike (the
    tests run the same shapes on a tiny model)."""
    rng = random.Random(seed)

    def size(x: int) -> int:
        return max(1, round(x * scale))

    def ids(n: int) -> list[int]:
        return [rng.randint(0, max_id) for _ in range(n)]

    reqs = []
    for count, (k, *prefix_len), input_len, output_len in parts:
        prefixes = [ids(size(rng.randint(*prefix_len))) for _ in range(k)]
        for _ in range(size(count)):
            head = prefixes[rng.randrange(k)] if k else []
            reqs.append((head + ids(size(rng.randint(*input_len))),
                         size(rng.randint(*output_len))))
    rng.shuffle(reqs)
    return [p for p, _ in reqs], [n for _, n in reqs]


NO_PREFIX = (0, 0, 0)
# The workloads of chapter 21 beyond nano-vllm's, unlike it on purpose: each stresses another
# part of the engine. (count, (shared prefixes, prefix length range), prompt range, output range)
WORKLOADS: dict[str, list[tuple[int, tuple[int, int, int], tuple[int, int], tuple[int, int]]]] = {
    # 384 requests behind 8 long shared prefixes: the radix cache answers most of each prompt
    "prefix": [(384, (8, 1024, 2048), (32, 128), (64, 256))],
    # 40 prompts of 4-8k tokens and short answers: prefill-bound
    "long": [(40, NO_PREFIX, (4096, 8192), (32, 128))],
    # 1,024 short requests: up to 1,024 running, past the largest CUDA graph (256)
    "short": [(1024, NO_PREFIX, (32, 128), (128, 384))],
    # all of it at once, smaller: chat, long prompts, shared prefixes, short ones
    "mixed": [(128, NO_PREFIX, (100, 1024), (100, 1024)), (8, NO_PREFIX, (4096, 8192), (32, 128)),
              (128, (4, 2048, 2048), (32, 128), (64, 256)),
              (384, NO_PREFIX, (32, 128), (128, 384))],
}
POOL_CAP = 480_000  # KV tokens per engine: two engines' pools (55 GiB each) share one H200


def the_workload(args: argparse.Namespace, name: str = "",
                 round_: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draw is always the same; ours are drawn anew each round (the same draw for
    every engine in a round), so a prefix cached in one round never answers the next."""
    name = name or args.workload[0]
    if name == "nano":
        return workload(args.requests, args.input_len, args.output_len, args.max_id)
    return shaped(WORKLOADS[name], args.scale, args.max_id, seed=round_)


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The same for both engines. nano: as chapter 21 has always run it (naive cache, 256 rows,
    a pool that holds the whole workload). Ours, one engine for all four: the radix cache,
    1,024 rows, room for the longest request, a pool of POOL_CAP tokens."""
    if args.workload == ["nano"]:
        prompts, lens = the_workload(args, "nano")
        pool = sum(map(len, prompts)) + sum(lens) + 4096
        config: dict[str, Any] = dict(max_seq_len_override=4096, cache_type="naive")
    else:
        pool = POOL_CAP
        longest = max(len(p) + k for p, k in (x for w in args.workload
                                                for x in zip(*the_workload(args, w))))
        config = dict(max_seq_len_override=-(-(longest + 1) // 1024) * 1024, cache_type="radix",
                      max_running_req=1024)
    config.update(max_extend_tokens=16384, page_size=1)
    if args.pool:
        config["num_page_override"] = args.pool
    elif _cuda():
        config["num_page_override"] = pool
    return config


def _cuda() -> Any:
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def _sync() -> None:
    if cuda := _cuda():
        cuda.synchronize()


def steps_detail(start: float, stamps: list[float], gaps: list[float]) -> dict[str, float]:
    """Where a round's time went, to tell a slow round from a fast one: the time before the
    first batch's result, the gaps between results (median, p90, longest), and the time spent
    in gaps over four times the median."""
    if not gaps:
        return {}
    ms = sorted(g * 1e3 for g in gaps)
    p50 = statistics.median(ms)
    return {"first_ms": round((stamps[0] - start) * 1e3, 2), "gap_p50_ms": round(p50, 3),
            "gap_p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "gap_max_ms": round(ms[-1], 2),
            "slow_ms": round(sum(g for g in ms if g > 4 * p50), 2), "steps": len(stamps)}


class MinisglWorker:
    """LLM.generate of whichever minisgl is on the path (ours or the official: same API)."""

    def __init__(self, args: argparse.Namespace, attn: str, graph: bool,
                 admission: str = "") -> None:
        from minisgl.core import SamplingParams
        from minisgl.llm import LLM

        self.args = args
        self.prompts, self.lens = the_workload(args)
        self.sp = SamplingParams
        config = engine_config(args)
        if admission:  # ours only: the official has no such setting
            config["admission"] = admission
        self.llm = LLM(args.model, attention_backend=attn, cuda_graph_max_bs=(256 if graph else 0),
                       **config)
        self.stamps: list[float] = []
        self.window: tuple[int, int, Any] | None = None  # (first step, last step, profiler)
        inner = self.llm.send_result

        def stamped(replies: Any) -> None:  # one call per scheduled batch, in both engines
            self.stamps.append(time.perf_counter())
            if self.window and len(self.stamps) in self.window[:2]:
                prof = self.window[2]
                prof.start() if len(self.stamps) == self.window[0] else prof.stop()
            inner(replies)

        self.llm.send_result = stamped  # type: ignore[method-assign]
        # warm-up: a few requests of the workload's shapes and sampling (a greedy warm-up left
        # FlashInfer's sampling kernels to be compiled inside the official's first timed run)
        self.llm.generate(self.prompts[:16], self.sp(temperature=0.6, max_tokens=32,
                                                     ignore_eos=True))

    def run(self, name: str, round_: int = 0) -> dict[str, Any]:
        prompts, lens = the_workload(self.args, name, round_ + 1)  # round 0's: the warm-up's
        params = ([self.sp(max_tokens=k) for k in lens] if self.args.eos  # greedy, EOS stops
                  else [self.sp(temperature=0.6, ignore_eos=True, max_tokens=k) for k in lens])
        if cuda := _cuda():
            cuda.reset_peak_memory_stats()
        self.stamps.clear()
        _sync()
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        _sync()
        seconds = time.perf_counter() - start
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return {"seconds": seconds, "output_tokens": sum(len(o["token_ids"]) for o in outs),
                "step_ms_p50": statistics.median(gaps) * 1e3 if gaps else None,
                "steps": len(self.stamps), "detail": steps_detail(start, self.stamps, gaps),
                "peak_gib": cuda.max_memory_allocated() / 2**30 if cuda else None}

    def profile(self, first: int = 300, steps: int = 50) -> dict[str, Any]:
        """The workload again, with the profiler on from step `first` for `steps` steps (mid-run,
        every request admitted): GPU busy time against wall time, kernels ranked."""
        import torch

        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.window = (first, first + steps, prof)
        self.run()
        self.window = None
        if len(self.stamps) < first + steps:
            raise RuntimeError(f"the run had {len(self.stamps)} steps, fewer than {first + steps}")
        wall = (self.stamps[first + steps - 1] - self.stamps[first - 1]) * 1e3
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        return {"steps": steps, "wall_ms": wall,
                "gpu_busy_ms": sum(e.device_time_total for e in events) / 1e3,
                "kernels": [[e.key[:90], e.device_time_total / 1e3, e.count]
                            for e in events[:15]]}

    def latency(self, prompt_len: int = 256, new_tokens: int = 256) -> dict[str, Any]:
        """One request: the time of `new_tokens` tokens, and the step from two runs' difference."""
        prompt = self.prompts[0][:prompt_len]
        times = {}
        for k in (1, new_tokens):
            _sync()
            start = time.perf_counter()
            self.llm.generate([prompt], self.sp(temperature=0.6, max_tokens=k, ignore_eos=True))
            _sync()
            times[k] = time.perf_counter() - start
        return {"seconds": times[new_tokens], "output_tokens": new_tokens,
                "step_ms_p50": (times[new_tokens] - times[1]) / (new_tokens - 1) * 1e3}

    def host_profile(self, repeat: int = 15) -> dict[str, Any]:
        """Where the time goes in three shapes, each on fresh prompts (no cache hit): one
        600-token prompt and its first token (a prefill step), 256 prompts of 64 tokens with
        64 tokens each (decode steps at batch 256), and, where the context allows, two prompts
        of 8,000 tokens and their first tokens (one long prefill step, GPU-bound). Per shape:
        the wall time alone (a short run's `repeat` times: median and all), the torch operators
        by host (self) time and the GPU kernels by device time under torch.profiler, and the
        Python functions by own time under cProfile (which slows Python calls, so read its
        shares, not its times)."""
        import cProfile
        import io
        import pstats

        import torch

        rng = random.Random(7)

        def draw(n: int, length: int) -> list[list[int]]:
            return [[rng.randint(0, self.args.max_id) for _ in range(length)] for _ in range(n)]

        out: dict[str, Any] = {}
        shapes = [("prefill", 1, 600, 1), ("decode", 256, 64, 64), ("long", 2, 8000, 1)]
        room = engine_config(self.args).get("max_seq_len_override", 0)
        for name, n, length, k in (s for s in shapes if s[2] < room):
            params = self.sp(temperature=0.6, max_tokens=k, ignore_eos=True)
            self.llm.generate(draw(n, length), params)  # warm-up of this shape
            walls = []
            for _ in range(repeat if k == 1 else 1):  # a prefill is short: sample it often
                _sync()
                start = time.perf_counter()
                self.llm.generate(draw(n, length), params)
                _sync()
                walls.append((time.perf_counter() - start) * 1e3)
            row: dict[str, Any] = {"wall_ms": statistics.median(walls),
                                   "wall_ms_all": [round(w, 2) for w in walls]}
            cpu, gpu = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
            with torch.profiler.profile(activities=[cpu, gpu]) as prof:
                self.llm.generate(draw(n, length), params)
                _sync()
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            row["launches"] = sum(e.count for e in events if "LaunchKernel" in e.key)
            row["ops"] = [[e.key[:70], e.self_cpu_time_total / 1e3, e.count] for e in events[:25]]
            kernels = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                             key=lambda e: -e.device_time_total)
            row["gpu_busy_ms"] = sum(e.device_time_total for e in kernels) / 1e3
            row["kernels"] = [[e.key[:90], e.device_time_total / 1e3, e.count]
                              for e in kernels[:15]]
            profiler = cProfile.Profile()
            profiler.enable()
            self.llm.generate(draw(n, length), params)
            _sync()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            row["cprofile"] = text.getvalue()
            out[name] = row
        return out

    def close(self) -> None:
        self.llm.shutdown()


class HFWorker:
    """transformers' continuous batching (the manager behind generate_batch), greedy, bf16."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import transformers

        self.prompts, self.lens = the_workload(args)
        dtype = torch.bfloat16 if _cuda() else torch.float32
        self.model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        self.model.to("cuda" if _cuda() else "cpu").eval()
        # no EOS: every request runs to its max_new_tokens, as ignore_eos does for the others
        self.gc = transformers.GenerationConfig(do_sample=False, eos_token_id=None,
                                                pad_token_id=0, max_new_tokens=max(self.lens))
        self.timeout = args.hf_timeout
        self._generate(self.prompts[:16], [32] * 16)

    def _generate(self, prompts: list[list[int]], lens: list[int]) -> int:
        manager = self.model.init_continuous_batching(generation_config=self.gc)
        manager.start()
        deadline, done, tokens = time.perf_counter() + self.timeout, 0, 0
        try:
            for p, k in zip(prompts, lens):
                manager.add_request(p, max_new_tokens=k)
            while done < len(prompts):
                if time.perf_counter() > deadline or not manager.is_running():
                    raise RuntimeError(f"HF stopped after {done}/{len(prompts)} requests")
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done, tokens = done + 1, tokens + len(result.generated_tokens)
        finally:
            manager.stop(block=True)
        return tokens

    def run(self, name: str = "nano", round_: int = 0) -> dict[str, Any]:
        if cuda := _cuda():
            cuda.reset_peak_memory_stats()
        _sync()
        start = time.perf_counter()
        tokens = self._generate(self.prompts, self.lens)
        _sync()
        return {"seconds": time.perf_counter() - start, "output_tokens": tokens,
                "step_ms_p50": None, "steps": None,
                "peak_gib": cuda.max_memory_allocated() / 2**30 if cuda else None}

    def close(self) -> None:
        pass


def worker_main(args: argparse.Namespace) -> None:
    """Serve the driver: `run`, `latency` and `quit` on stdin, one tagged JSON line each."""
    engine, attn, graph, overlap, admission = (args.worker.split(":") + [""] * 4)[:5]
    start = time.perf_counter()
    if engine == "hf":
        worker: MinisglWorker | HFWorker = HFWorker(args)
    else:
        os.environ["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "1" if overlap == "off" else "0"
        worker = MinisglWorker(args, attn, graph == "graph", admission)
    print(TAG + json.dumps({"startup_s": time.perf_counter() - start,
                            "versions": versions(engine)}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "profile" and isinstance(worker, MinisglWorker):
            result = worker.profile()
        elif command == "hostprofile" and isinstance(worker, MinisglWorker):
            result = worker.host_profile()
        elif command == "latency" and isinstance(worker, MinisglWorker):
            result = worker.latency()
        else:  # run WORKLOAD ROUND
            _, name, round_ = command.split()
            result = worker.run(name, int(round_))
        print(TAG + json.dumps(result), flush=True)
    worker.close()


def versions(engine: str) -> dict[str, str]:
    """The packages a worker ran with, the minisgl one named by where it came from."""
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "flashinfer-python", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if engine != "hf":
        import minisgl

        where = Path(list(minisgl.__path__)[0]).parent.name  # the official has no __init__.py
        out["minisgl"] = f"{engine}, from {where}/"
    return out


@dataclass
class Worker:
    """The driver's handle on one worker process."""
    config: str
    proc: subprocess.Popen

    def ask(self, command: str | None = None) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        if command:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            sys.stderr.write(line)
        raise RuntimeError(f"worker {self.config} exited with {self.proc.wait()}")


def spawn(config: str, args: argparse.Namespace) -> Worker:
    engine = config.split(":")[0]
    if engine == "official" and not args.official:
        raise SystemExit("official configurations need --official PATH (its python/ folder)")
    ours = ROOT / "python" if (ROOT / "python").is_dir() else ROOT  # the repo, or a chapter tree
    package = Path(args.official) if engine == "official" else ours
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and Path(p).resolve() != ours.resolve()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package), *inherited]))
    argv = [sys.executable, __file__, "--worker", config, "--model", args.model,
            "--workload", *args.workload, "--scale", str(args.scale),
            "--requests", str(args.requests), "--hf-timeout", str(args.hf_timeout),
            "--max-id", str(args.max_id), "--input-len", *map(str, args.input_len),
            "--output-len", *map(str, args.output_len), "--pool", str(args.pool),
            *(["--eos"] if args.eos else [])]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1)
    return Worker(config, proc)


def run_group(configs: list[str], args: argparse.Namespace,
              report: Callable[[list[dict[str, Any]]], None]) -> None:
    """Start the group's workers, then for each workload `args.rounds` rounds of one timed run
    each, in turns (the order rotates each round); `report` gets each workload's rows."""
    from tqdm import tqdm

    workers = [spawn(c, args) for c in configs]
    started = {w.config: w.ask() for w in workers}
    rounds = 1 if configs == ["hf"] else args.rounds
    for i, name in enumerate(args.workload):
        rows = {w.config: {"config": w.config, "workload": name, **started[w.config],
                           "runs": []} for w in workers}
        with tqdm(total=rounds * len(workers), desc=f"{name}: {' '.join(configs)}",
                  file=sys.stderr) as bar:
            for r in range(rounds):
                for w in workers[r % len(workers):] + workers[:r % len(workers)]:
                    run = w.ask(f"run {name} {r}")
                    rows[w.config]["runs"].append(run)
                    bar.write(f"round {r} {w.config}: {run['output_tokens']} tokens in "
                              f"{run['seconds']:.2f} s, {run.get('steps')} batches",
                              file=sys.stderr)
                    bar.update()
        for w in workers:  # once per group, with the first workload's rows
            if i > 0 or w.config.startswith("hf"):
                continue
            if args.latency:
                rows[w.config]["latency"] = [w.ask("latency") for _ in range(args.rounds)]
            if args.profile:
                rows[w.config]["profile"] = w.ask("profile")
            if args.host_profile:
                rows[w.config]["host_profile"] = w.ask("hostprofile")
        report([summarise(row) for row in rows.values()])
    for w in workers:
        assert w.proc.stdin
        w.proc.stdin.write("quit\n")
        w.proc.stdin.flush()
        w.proc.wait()


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    runs = row.pop("runs")
    rates = [r["output_tokens"] / r["seconds"] for r in runs]  # a round's draw is the same for
    out = {**row, "seconds": statistics.median(r["seconds"] for r in runs),  # every engine
           "seconds_all": [round(r["seconds"], 3) for r in runs],
           "output_tokens": runs[0]["output_tokens"],
           "tokens_all": [r["output_tokens"] for r in runs],
           "steps_all": [r.get("steps") for r in runs],  # scheduled batches
           "tok_s": statistics.median(rates), "tok_s_all": [round(x, 1) for x in rates],
           "peak_gib": max((r["peak_gib"] or 0) for r in runs) or None,
           "rounds_detail": [r.get("detail") for r in runs]}
    steps = [r["step_ms_p50"] for r in runs if r["step_ms_p50"] is not None]
    out["step_ms_p50"] = statistics.median(steps) if steps else None
    if lat := row.pop("latency", None):
        out["latency"] = {"tok_s": statistics.median(r["output_tokens"] / r["seconds"]
                                                     for r in lat),
                          "step_ms": statistics.median(r["step_ms_p50"] for r in lat),
                          "runs": len(lat)}
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    w = max([26, *(len(r["config"]) for r in rows)])
    lines = [f"{'configuration':<{w}} {'seconds':>8} {'out tok':>8} {'tok/s':>8} {'step p50':>9}"
             f" {'peak GiB':>8} {'start s':>7}  batch 1 (tok/s, ms/step)"]
    for r in rows:
        lat = r.get("latency")
        one = f"{lat['tok_s']:.0f}, {lat['step_ms']:.2f}" if lat else "-"
        lines.append(f"{r['config']:<{w}} {r['seconds']:8.2f} {r['output_tokens']:8d} "
                     f"{r['tok_s']:8.0f} {num(r['step_ms_p50'], '9.2f')} "
                     f"{num(r['peak_gib'], '8.1f')} {r['startup_s']:7.1f}  {one}")
    return lines


def ratios(rows: list[dict[str, Any]]) -> str:
    """ours / official output tok/s, round by round (both ran the same draw in a round); a line
    per configuration of ours, named when there are several."""
    ours = [r for r in rows if r["config"].startswith("ours")]
    official = next((r for r in rows if r["config"].startswith("official")), None)
    if not ours or official is None:
        return ""
    lines = []
    for row in ours:
        per = [a / b for a, b in zip(row["tok_s_all"], official["tok_s_all"])]
        name = "ours" if len(ours) == 1 else row["config"]
        lines.append(f"{name} / official per round: {' '.join(f'{x:.3f}' for x in per)}; "
                     f"median {statistics.median(per):.3f}")
    return "\n".join(lines)


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
             if ln.startswith("model name")]
    return f"{names[0] if names else 'CPU'}, {os.cpu_count()} logical CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--group", action="append", nargs="+", default=[], metavar="CONFIG",
                        help="configurations run side by side (repeat for more groups)")
    parser.add_argument("--official", default="", help="the official's python/ folder")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    parser.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    parser.add_argument("--max-id", type=int, default=10000, help="prompt ids are 0..max-id")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", action="store_true",
                        help="also one request of 256 tokens (batch 1), `rounds` times")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 50 decode steps mid-run (GPU busy vs wall, kernels)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also profile a 600-token and a 16k prefill, 64 steps at 256")
    parser.add_argument("--workload", nargs="+", default=["nano"], choices=["nano", *WORKLOADS],
                        help="nano-vllm's (--requests, --input-len, --output-len), alone, or "
                        "any of ours, run one after another by the same engines")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink our workloads' counts and lengths (tests)")
    parser.add_argument("--eos", action="store_true",
                        help="greedy requests that stop at the model's EOS (max_tokens a bound)")
    parser.add_argument("--pool", type=int, default=0,
                        help="every engine's KV pool in tokens (default: room for the workload)")
    parser.add_argument("--hf-timeout", type=float, default=600)
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    if "nano" in args.workload and len(args.workload) > 1:
        raise SystemExit("--workload nano runs alone (its engines are configured apart)")
    heads = []
    for name in args.workload:
        prompts, lens = the_workload(args, name, 1)  # the first timed round's draw
        heads.append(f"workload {name}: {len(prompts)} requests, prompts "
                     f"{sum(map(len, prompts))} tokens, outputs {sum(lens)} tokens asked "
                     f"(round 1); {args.rounds} rounds per group, in turns")
        print(heads[-1], flush=True)
    rows: list[dict[str, Any]] = []

    def report(new: list[dict[str, Any]]) -> None:
        rows.extend(new)
        print(f"workload {new[0]['workload']}:")
        print("\n".join(table(new)), flush=True)
        for row in new:
            if prof := row.get("profile"):
                print(f"profile {row['config']}: {prof['steps']} steps mid-run, wall "
                      f"{prof['wall_ms']:.1f} ms, GPU busy {prof['gpu_busy_ms']:.1f} ms")
                for name, ms, calls in prof["kernels"]:
                    print(f"  {ms:9.2f} ms {calls:6d} calls  {name}")
            for shape, prof in row.get("host_profile", {}).items():
                print(f"host profile {row['config']} {shape}: wall {prof['wall_ms']:.1f} ms "
                      f"(median of {len(prof.get('wall_ms_all', [0]))}), "
                      f"{prof['launches']} kernel launches; torch ops by host time:")
                for name, ms, calls in prof["ops"]:
                    print(f"  {ms:9.2f} ms {calls:6d} calls  {name}")
                if kernels := prof.get("kernels"):
                    print(f"  GPU kernels by device time (busy {prof['gpu_busy_ms']:.1f} ms):")
                    for name, ms, calls in kernels:
                        print(f"  {ms:9.2f} ms {calls:6d} calls  {name}")
                print(prof["cprofile"])
        if line := ratios(new):
            print(line, flush=True)
        if args.json:
            write_json(args, rows)

    for group in args.group:
        run_group(group, args, report)
    print("\n".join(heads))
    for name in args.workload:
        print(f"workload {name}:")
        print("\n".join(table([r for r in rows if r["workload"] == name])))
        print(ratios([r for r in rows if r["workload"] == name]))


def write_json(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    import torch

    result = {"bench": "offline", "machine": machine(), "date": date.today().isoformat(),
              "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
              "command": shlex.join(["python", *sys.argv]),
              "workload": {"names": args.workload, "scale": args.scale,
                           "requests": args.requests, "input_len": args.input_len,
                           "output_len": args.output_len,
                           "asked": {w: sum(the_workload(args, w, 1)[1]) for w in args.workload}},
              "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
