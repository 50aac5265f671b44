"""The host's cost of preparing and launching one prompt's prefill, ours beside the official's.

Each engine runs in a process of its own (its minisgl first on the path) as an offline LLM:
single prompts of --tokens random tokens, none sharing a prefix, each asked for one token, so
every step is one prompt's prefill with an empty queue behind it, as at low load on a server.
The scheduler's `_schedule_next_batch` (pick the batch and prepare its tensors) and `_forward`
(launch it) are timed on the host, the GPU not waited for; then the same prompts again under
cProfile, which ranks where the preparation's time goes. The processes run in turns (A B B A
for two rounds), so neither side is always first on a fresh machine.

    python benchmark/prepare_cost.py --model /tmp/q06 --engine ours=python \
        --engine official=/tmp/official/python [--rounds 2] [--prompts 40] [--tokens 650]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def worker(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    from minisgl.scheduler.scheduler import Scheduler

    gpu = torch.cuda.is_available()
    llm = LLM(a.model, attention_backend="fi" if gpu else "auto", cuda_graph_max_bs=0,
              num_page_override=a.pages)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(a.seed)
    times: dict[str, list[float]] = {"prepare": [], "launch": []}
    profiler: cProfile.Profile | None = None
    schedule, forward = Scheduler._schedule_next_batch, Scheduler._forward

    def timed_schedule(self: Any) -> Any:
        if profiler:
            profiler.enable()
        t = time.perf_counter()
        out = schedule(self)
        dt = time.perf_counter() - t
        if profiler:
            profiler.disable()
        if out is not None and out.batch.is_prefill:
            times["prepare"].append(dt * 1e3)
        return out

    def timed_forward(self: Any, forward_input: Any) -> Any:
        t = time.perf_counter()
        out = forward(self, forward_input)
        if forward_input.batch.is_prefill:
            times["launch"].append((time.perf_counter() - t) * 1e3)
        return out

    Scheduler._schedule_next_batch = timed_schedule  # type: ignore[method-assign]
    Scheduler._forward = timed_forward  # type: ignore[method-assign]

    def run(n: int) -> None:
        for _ in range(n):
            prompt = [rng.randrange(vocab) for _ in range(a.tokens)]
            llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))

    run(5)  # warm-up: the first prefills compile and allocate
    for v in times.values():
        v.clear()
    run(a.prompts)
    result: dict[str, Any] = {
        name: {"p50": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
        for name, v in times.items()}
    profiler = cProfile.Profile()
    run(a.prompts)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(((tt, nc, f"{Path(f).name}:{line}({fn})" if line else fn)
                   for (f, line, fn), (_, nc, tt, _, _) in stats.items()), reverse=True)
    result["profile"] = [{"us_per_prefill": 1e6 * tt / a.prompts,
                          "calls_per_prefill": nc / a.prompts, "function": name}
                         for tt, nc, name in rows[: a.top]]
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", action="append", required=True, metavar="NAME=PYTHON_DIR")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--tokens", type=int, default=650)
    p.add_argument("--pages", type=int, default=200_000, help="KV pool size (pages)")
    p.add_argument("--top", type=int, default=15, help="profile rows kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every run here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    engines = [e.partition("=")[::2] for e in a.engine]
    runs: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        for name, path in order:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(Path(path).resolve())] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
            args = [sys.executable, __file__, "--worker", "--model", a.model, "--engine", name,
                    "--prompts", str(a.prompts), "--tokens", str(a.tokens), "--pages",
                    str(a.pages), "--top", str(a.top), "--seed", str(a.seed + rnd)]
            proc = subprocess.run(args, env=env, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                raise SystemExit(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            run = dict(json.loads(line[len("RESULT "):]), engine=name, round=rnd)
            runs.append(run)
            print(f"round {rnd} {name:>10}: prepare p50 {run['prepare']['p50']:.3f} ms "
                  f"({run['prepare']['min']:.3f}–{run['prepare']['max']:.3f}), launch p50 "
                  f"{run['launch']['p50']:.3f} ms, {run['prepare']['n']} prefills", flush=True)
    for name, _ in engines:
        mine = [r for r in runs if r["engine"] == name]
        print(f"\n{name}: prepare p50 per run "
              + ", ".join(f"{r['prepare']['p50']:.3f}" for r in mine) + " ms; the last run's "
              "profile of the preparation (µs per prefill, calls per prefill, function):")
        for row in mine[-1]["profile"]:
            print(f"    {row['us_per_prefill']:9.1f} {row['calls_per_prefill']:7.1f}  "
                  f"{row['function'][:110]}")
    if a.json:
        a.json.write_text(json.dumps({"bench": "prepare_cost", "argv": sys.argv[1:],
                                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
