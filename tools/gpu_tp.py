"""Chapter 16's tensor parallelism on two GPUs (issue "11 ·"): two ranks over NCCL against one
rank on the same machine, the server at --tp 2, and the speed of TP=1 against TP=2.

    python tools/gpu_tp.py --model /tmp/q06   # two GPUs; models/tiny-* made, q06 by models.py
    python tools/gpu_tp.py --device cpu       # the same over gloo on the CPU (tiny models only)

- tokens: each tiny model in float32, and --model in bfloat16: the greedy tokens of both ranks
  of TP=2 equal TP=1's, and the logits the sampler sees differ from TP=1's by at most 1e-4
  (float32) or the GPU tests' bfloat16 tolerance, relative, step by step (teacher-forced rows).
- serve: `python -m minisgl --tp 2`: one streamed chat completion through the openai client,
  then SIGTERM, after which none of its processes may be left (tests/gpu/test_gpu_serve.py's run).
- speed (--model): issue 5's 64-request workload at TP=1 and TP=2, FlashInfer and graphs where
  they exist, rounds in turns after a warm-up; then a profile of TP=2's rank 0 that gives the
  NCCL kernels' time per call and per layer of a decode step.

Every rank is its own process (spawned), as in chapter 16; rank r uses cuda:r. Prints one line
per check and a summary; exits 1 if any check fails. CI never runs this.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tools")]

import torch  # noqa: E402
from gpu_common import (  # noqa: E402
    BF16_TOL,
    MODELS,
    PROMPTS,
    ServeRun,
    relative_errors,
    run_server,
    speed_workload,
)


def rank_main(rank: int, size: int, device: str, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """One rank: builds an LLM on `load`, runs `generate` and `profile` on it, `close`s it."""
    from minisgl.core import SamplingParams
    from minisgl.distributed import DistributedInfo
    from minisgl.llm import LLM

    llm: Any = None
    seen: list[torch.Tensor] = []
    while (msg := inbox.get())[0] != "quit":
        command, args = msg
        try:
            if command == "load":
                start = time.perf_counter()
                llm = LLM(args["path"], dtype=getattr(torch, args["dtype"]), device=device,
                          tp_info=DistributedInfo(rank, size), dist_init=args["rendezvous"],
                          **args["config"])
                if args["spy"]:
                    llm.engine.sampler.sample = spying(llm.engine.sampler.sample, seen)
                reply: Any = time.perf_counter() - start
            elif command == "generate":
                seen.clear()
                params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in args["lens"]]
                before = llm.stats.decode_batches
                _sync(device)
                start = time.perf_counter()
                out = llm.generate(args["prompts"], params)
                _sync(device)
                reply = {"seconds": time.perf_counter() - start,
                         "steps": llm.stats.decode_batches - before,
                         "tokens": [o["token_ids"] for o in out], "logits": list(seen)}
            elif command == "profile":
                reply = nccl_profile(llm, args["prompts"], args["lens"], device)
            elif command == "close":
                llm.shutdown()
                llm, reply = None, None
            outbox.put((rank, "ok", reply))
        except Exception as exc:  # noqa: BLE001 (the parent reports it and stops the group)
            outbox.put((rank, "error", f"{type(exc).__name__}: {exc}"[:500]))


def spying(sample: Any, seen: list[torch.Tensor]) -> Any:
    """The sampler's sample, keeping a CPU copy of every logits it is given."""
    return lambda logits, args: seen.append(logits.float().cpu()) or sample(logits, args)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def nccl_profile(llm: Any, prompts: list[list[int]], lens: list[int], device: str
                 ) -> dict[str, Any]:
    """One generate under the torch profiler: the NCCL kernels' calls and time against every
    kernel's, and the decode steps it took."""
    from torch.profiler import ProfilerActivity, profile

    from minisgl.core import SamplingParams

    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in lens]
    before = llm.stats.decode_batches
    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        llm.generate(prompts, params)
        _sync(device)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 or device == "cpu"]
    total = sum(e.device_time_total if device == "cuda" else e.self_cpu_time_total
                for e in kernels)
    nccl = [e for e in kernels if any(k in e.key.lower() for k in ("nccl", "all_reduce"))]
    return {"steps": llm.stats.decode_batches - before,
            "layers": llm.config.model_config.num_layers,
            "nccl": [(e.key[:90], e.count, (e.device_time_total if device == "cuda"
                                             else e.cpu_time_total) / 1e3) for e in nccl],
            "all_ms": total / 1e3}


class Group:
    """`size` rank processes and their mailboxes; every command goes to all and waits for all."""

    def __init__(self, size: int, device: str) -> None:
        ctx = mp.get_context("spawn")
        self.size, self.outbox = size, ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(size)]
        self.procs = [ctx.Process(target=rank_main, args=(r, size, device, q, self.outbox))
                      for r, q in enumerate(self.inboxes)]
        for p in self.procs:
            p.start()

    def ask(self, command: str, timeout: float = 600, **args: Any) -> list[Any]:
        for q in self.inboxes:
            q.put((command, args))
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.size:
            left = deadline - time.monotonic()
            dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
            if left <= 0 or dead:
                raise RuntimeError(f"{command}: ranks {sorted(replies)} answered, exit codes "
                                   f"{dead}, {max(0, left):.0f} s left")
            try:
                rank, status, reply = self.outbox.get(timeout=min(left, 1.0))
            except queue.Empty:  # look at the processes again
                continue
            if status == "error":
                raise RuntimeError(f"{command} on rank {rank}: {reply}")
            replies[rank] = reply
        return [replies[r] for r in range(self.size)]

    def load(self, path: Path, dtype: str, spy: bool, **config: Any) -> float:
        rendezvous = f"file://{tempfile.mkdtemp()}/rendezvous" if self.size > 1 else ""
        return max(self.ask("load", path=str(path), dtype=dtype, spy=spy, config=config,
                            rendezvous=rendezvous))

    def stop(self) -> None:
        for q in self.inboxes:
            q.put(("quit", None))
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def check_tokens(path: Path, dtype: str, device: str, groups: dict[int, Group]) -> list[str]:
    """TP=2 against TP=1 on PROMPTS, 12 greedy tokens each; logits compared step by step."""
    tol = 1e-4 if dtype == "float32" else BF16_TOL
    results = {}
    for size, group in groups.items():
        group.load(path, dtype, spy=True, num_page_override=512)
        results[size] = group.ask("generate", prompts=PROMPTS, lens=[12] * len(PROMPTS))
        group.ask("close")
    one = results[1][0]
    lines = []
    for rank, got in enumerate(results[2]):
        same = sum(a == b for a, b in zip(got["tokens"], one["tokens"]))
        errs = relative_errors(got["tokens"], one["tokens"], got["logits"], one["logits"])
        worst = max(errs, default=float("nan"))
        ok = same == len(PROMPTS) and errs and worst <= tol
        lines.append(f"{'ok  ' if ok else 'FAIL'} tokens {path.name} {dtype} rank {rank} of 2 "
                     f"on {device}: {same}/{len(PROMPTS)} prompts with TP=1's 12 tokens; logits "
                     f"relative error at most {worst:.1e} over {len(errs)} steps (limit {tol})")
    return lines


def check_speed(path: Path, n: int, rounds: int, attn: str, groups: dict[int, Group]
                ) -> list[str]:
    """TP=1 and TP=2 on issue 5's workload in bfloat16, in turns; then TP=2's NCCL profile."""
    prompts, lens = speed_workload(path, n)
    config = dict(attention_backend=attn, max_running_req=n, cache_type="naive",
                  num_page_override=sum(map(len, prompts)) + sum(lens) + 1024)
    lines = [f"info speed: {n} requests, prompts {sum(map(len, prompts))} tokens, outputs "
             f"{sum(lens)} tokens, bfloat16, {path.name}, --attn {attn}, graphs on, overlap on; "
             f"median of {rounds} rounds in turns after a warm-up run of each"]
    print(lines[0], flush=True)
    for size, group in groups.items():
        ready = group.load(path, "bfloat16", False, **config)
        lines.append(f"info speed: TP={size} ready in {ready:.1f} s")
    runs: dict[int, list[dict[str, Any]]] = {size: [] for size in groups}
    for i in range(rounds + 1):  # round 0 warms up
        for size in sorted(groups, reverse=bool(i % 2)):
            reply = groups[size].ask("generate", prompts=prompts, lens=lens)[0]
            print(f"    round {i} TP={size}: {reply['seconds']:.2f} s", flush=True)
            if i:
                runs[size].append(reply)
    for size, rs in runs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        step = statistics.median(r["seconds"] / r["steps"] for r in rs)
        lines.append(f"info speed: TP={size} {sec:.2f} s, {sum(lens) / sec:.0f} output tok/s, "
                     f"{step * 1e3:.2f} ms per decode step (seconds / decode batches)")
    prof = groups[2].ask("profile", prompts=prompts, lens=[min(k, 64) for k in lens])[0]
    calls = sum(c for _, c, _ in prof["nccl"])
    ms = sum(t for _, _, t in prof["nccl"])
    each = 1e3 * ms / max(calls, 1)
    lines.append(f"info profile TP=2 rank 0: 64 tokens per request, {prof['steps']} decode "
                 f"steps, {prof['layers']} layers; collectives {ms:.1f} ms in {calls} calls "
                 f"({each:.1f} us each; a layer has two, after attention and after the MLP: "
                 f"{2 * each:.1f} us per layer per step) of {prof['all_ms']:.1f} ms of kernels "
                 f"({100 * ms / max(prof['all_ms'], 1e-9):.1f}%)")
    lines += [f"info   {name}: {count} calls, {t:.2f} ms" for name, count, t in prof["nccl"]]
    for group in groups.values():
        group.ask("close")
    return lines


def serve_lines(run: ServeRun) -> list[str]:
    """A server run as the lines this script prints, with a verdict on the stream and the stop."""
    return [f"info serve: {' '.join(run.command[1:])}",
            f"info serve: ready after {run.ready_s:.0f} s",
            *[f"info serve log: {line}" for line in run.log_lines],
            f"{'ok  ' if run.streamed_to_length else 'FAIL'} serve: streamed chat completion, "
            f"{run.chunks} chunks in {run.stream_s:.2f} s, finish_reason {run.finish_reason}; "
            f"text (random weights) {run.text[:60]!r}",
            f"{'ok  ' if run.stopped_clean else 'FAIL'} serve: SIGTERM, exit code "
            f"{run.exit_code}; {run.children} child processes, {run.left_running} of them left "
            "running"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a Qwen3-0.6B-shaped model (bfloat16)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attn", default="fi", help="speed: the attention backend")
    parser.add_argument("--checks", nargs="+", default=["tokens", "serve", "speed"],
                        choices=["tokens", "serve", "speed"])
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"{torch.cuda.device_count()} CUDA devices: TP=2 needs two (or --device cpu)")
    where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
             if args.device == "cuda" else "CPU")
    print(f"{where}; torch {torch.__version__}; date {datetime.date.today()}", flush=True)
    groups = {size: Group(size, args.device) for size in (1, 2)}
    lines: list[str] = []
    try:
        if "tokens" in args.checks:
            for name in MODELS:
                lines += check_tokens(ROOT / "models" / name, "float32", args.device, groups)
                print("\n".join(lines[-2:]), flush=True)
            if args.model:
                lines += check_tokens(args.model, "bfloat16", args.device, groups)
                print("\n".join(lines[-2:]), flush=True)
        if "speed" in args.checks and args.model:
            lines += check_speed(args.model, args.requests, args.rounds,
                                 args.attn if args.device == "cuda" else "torch", groups)
    except RuntimeError as exc:
        lines.append(f"FAIL {exc}")
    finally:
        for group in groups.values():
            group.stop()
    if "serve" in args.checks:
        lines += serve_lines(run_server(args.model or ROOT / "models" / "tiny-qwen3",
                                        ("--tp", "2")))
    print("\n".join(lines))
    failed = sum(line.startswith("FAIL") for line in lines)
    print(f"summary: {sum(line.startswith(('ok', 'FAIL')) for line in lines) - failed} ok, "
          f"{failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
