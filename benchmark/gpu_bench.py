"""GPU timings: ours against HF, decode steps, our kernels, the sampler, a MoE layer.

The timing half of the old tools/gpu_check.py (issue "14 ·"): ours against HF on issue 5's
workload (speed), decode step times with a profile (steps; ksteps with our kernels against
torch's ops), our kernels against torch's ops per call (kernels), the draws of the sampler
(sampler) and one Qwen3-30B-A3B MoE layer (moe). It prints tables and judges nothing:
correctness is tests/gpu's (`python -m pytest -m gpu tests/gpu`).

    python benchmark/gpu_bench.py speed --model /tmp/q06 --rounds 5 --no-cb
    python benchmark/gpu_bench.py steps ksteps --model /tmp/q06 --rounds 3
    python benchmark/gpu_bench.py kernels sampler moe

/tmp/q06: `tools/models.py random --arch qwen3 --preset 0.6b --out /tmp/q06`. The timers are
benchmark/timing.py's. CI has no GPU and never runs this; the book records its output with the
machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tools")]

import torch  # noqa: E402
import transformers  # noqa: E402
from gpu_common import (  # noqa: E402
    MOE_SHAPE,
    cuda_llm,
    hf_on_cuda,
    kernel_cases,
    moe_layer,
    speed_workload,
)
from timing import cuda_ms, graph_ms, ms_per_step, wall_s  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402

STEPS = 64  # decode steps in one step-time measurement


def say(line: str) -> None:
    print(line, flush=True)


def in_turns(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Every run once per round, in turns, `rounds` + 1 rounds: round 0 warms every kernel and
    shape up and is not kept. Each run returns its seconds."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds + 1):
        for name, run in runs.items():
            seconds = run()
            say(f"    round {i} {name}: {seconds:.1f} s")
            if i:
                times[name].append(seconds)
    return times


def speed(path: Path, n: int, rounds: int, cb: bool, attn: str) -> None:
    """n requests, input and output lengths uniform in 100..512 (seed 0), bfloat16: our
    LLM.generate (overlap on and off) and HF's padded generate, each run `rounds` times in
    turns after a warm-up run of each, medians reported; HF continuous batching once."""
    prompts, out_lens = speed_workload(path, n)
    in_lens = [len(p) for p in prompts]
    useful = sum(out_lens)
    say(f"speed workload: {n} requests, prompts {sum(in_lens)} tokens, outputs {useful} "
        f"tokens (max {max(out_lens)}), bfloat16, {path.name}; median of {rounds} rounds "
        f"taken in turns after one warm-up run each")

    def row(label: str, times: list[float], extra: str = "") -> None:
        sec = statistics.median(times)
        say(f"  {label:<42} {sec:7.1f} s  {useful / sec:8.0f} output tok/s"
            f" (min {min(times):.1f} s, max {max(times):.1f} s)" + extra)

    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in out_lens]
    steps: dict[bool, list[float]] = {True: [], False: []}
    gc = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                       max_new_tokens=max(out_lens))
    # one LLM (one Engine per process), overlap switched per run; KV room for every request;
    # no prefix cache, so that every run computes every prompt again, as HF does
    with cuda_llm(path, True, dtype=torch.bfloat16, max_running_req=n, cache_type="naive",
                  num_page_override=sum(in_lens) + useful + 1024, attention_backend=attn) as llm:
        say(f"  ours: --attn {attn}, graphs for batch sizes {llm.engine.graph_runner.sizes}")
        hf = hf_on_cuda(path, torch.bfloat16)

        def ours(overlap: bool) -> float:
            llm.overlap = overlap
            before = llm.stats.decode_batches
            seconds = wall_s(lambda: llm.generate(prompts, params))
            steps[overlap].append(seconds / (llm.stats.decode_batches - before))
            return seconds

        x, mask = left_padded(prompts)
        runs = {"ours LLM.generate, overlap on": lambda: ours(True),
                "ours LLM.generate, overlap off": lambda: ours(False),
                "HF generate, one left-padded batch": lambda: wall_s(
                    lambda: hf.generate(x, attention_mask=mask, generation_config=gc))}
        times = in_turns(runs, rounds)
    for overlap in (True, False):
        del steps[overlap][0]
    for name, ts in times.items():
        extra = ""
        if name.startswith("ours"):
            per_step = statistics.median(steps[name.endswith("on")])
            extra = f", {per_step * 1e3:.1f} ms per decode step"
        elif name.startswith("HF generate"):
            extra = f" (computes {n * max(out_lens)} output tokens)"
        row(name, ts, extra)
    torch.cuda.empty_cache()
    if not cb:
        return
    try:
        hf_continuous_batching(hf, gc, prompts[:4], [8] * 4, time.perf_counter() + 60)  # warm
        row("HF continuous batching (once)", [wall_s(lambda: hf_continuous_batching(
            hf, gc, prompts, out_lens, time.perf_counter() + 150))])
    except Exception as exc:  # noqa: BLE001 (report what failed, keep the other rows)
        say(f"  HF continuous batching failed: {type(exc).__name__}: {exc}"[:300])


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """All prompts in one batch on CUDA, padded on the left with 0, and its attention mask."""
    width = max(len(p) for p in prompts)
    x = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return x.cuda(), mask.cuda()


def hf_continuous_batching(hf: Any, gc: Any, reqs: list[list[int]], lens: list[int],
                           deadline: float) -> None:
    """transformers' continuous batching, each request with its own output length."""
    manager = hf.init_continuous_batching(generation_config=gc)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=k) for p, k in zip(reqs, lens)]
        done = 0
        while done < len(ids):
            if time.perf_counter() > deadline or not manager.is_running():
                raise RuntimeError(f"stopped after {done}/{len(ids)} requests")
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
    finally:
        manager.stop(block=True)


def step_prompts() -> dict[int, list[list[int]]]:
    """Batches of 1 and 64 prompts of 128 random ids (seed 0), for the step times."""
    g = torch.Generator().manual_seed(0)
    return {bs: [torch.randint(10, 150000, (128,), generator=g).tolist() for _ in range(bs)]
            for bs in (1, 64)}


def step_llm(path: Path, **config: Any) -> AbstractContextManager[Any]:
    """The LLM of the step times and profiles: bfloat16, overlap on, 64 running, naive cache,
    room for 64 sequences of 256 tokens."""
    return cuda_llm(path, True, dtype=torch.bfloat16, max_running_req=64, cache_type="naive",
                    num_page_override=64 * 256, max_seq_len_override=256, **config)


def llm_step_times(path: Path, prompts: dict[int, list[list[int]]],
                   **config: Any) -> dict[int, list[float]]:
    """One step_llm (`config`): two step-time measurements (ms) per batch size."""
    with step_llm(path, **config) as llm:
        return {bs: [ms_per_step(lambda k, ps=ps: llm.generate(
            ps, SamplingParams(max_tokens=k, ignore_eos=True)), STEPS) for _ in range(2)]
            for bs, ps in prompts.items()}


def step_rounds(measures: dict[str, Callable[[], dict[int, list[float]]]], rounds: int,
                label: str) -> dict[str, tuple[float, float]]:
    """Every measurement once per round, in turns, `rounds` + 1 rounds (round 0 warms up and is
    not kept): name -> the medians at batch 1 and 64 of what its rounds measured."""
    times: dict[tuple[str, int], list[float]] = {(name, bs): [] for name in measures
                                                 for bs in (1, 64)}
    for i in range(rounds + 1):
        for name, measure in measures.items():
            for bs, ms in measure().items():
                times[(name, bs)] += ms if i else []
        say(f"    {label} round {i} done")
    return {name: (statistics.median(times[(name, 1)]), statistics.median(times[(name, 64)]))
            for name in measures}


def steps(path: Path, rounds: int) -> None:
    """Decode step time on the Qwen3-0.6B shape, bfloat16, prompts of 128 tokens: eager vs graph
    and torch vs fi, at batch 1 and 64, HF generate beside. A figure is the median over
    `rounds` rounds (configurations in turns) of two measurements, each the mean of 64 decode
    steps: (time of 65 tokens - time of 1 token) / 64. Then a profile of 16 steps at batch 64."""
    prompts = step_prompts()
    hf = hf_on_cuda(path, torch.bfloat16)

    def ours(attn: str, max_bs: int) -> Callable[[], dict[int, list[float]]]:
        return lambda: llm_step_times(path, prompts, attention_backend=attn,
                                      cuda_graph_max_bs=max_bs)

    def hf_times() -> dict[int, list[float]]:
        times: dict[int, list[float]] = {}
        for bs, ps in prompts.items():
            x = torch.tensor(ps, device="cuda")
            times[bs] = [ms_per_step(lambda k, x=x: hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                do_sample=False), STEPS) for _ in range(2)]
        return times

    medians = step_rounds({"torch eager": ours("torch", 0), "torch graph": ours("torch", 64),
                           "fi eager": ours("fi", 0), "fi graph": ours("fi", 64),
                           "HF": hf_times}, rounds, "steps")
    torch.cuda.empty_cache()
    say(f"decode step (ms), {path.name}, bfloat16, prompts of 128 tokens; median of "
        f"{2 * rounds} measurements, each the mean of {STEPS} steps")
    say(f"  {'':<12} {'batch 1':>9} {'batch 64':>9}")
    hf1 = medians["HF"][0]
    for name, (a, b) in medians.items():
        say(f"  {name:<12} {a:9.2f} {b:9.2f}   (HF / this at batch 1: {hf1 / a:.1f}x)")
    profile_steps(path, prompts[64])


def set_kernels(mode: str) -> None:
    """MINISGL_KERNELS for the LLMs made next in this process (chapter 19)."""
    from minisgl import kernel

    os.environ["MINISGL_KERNELS"] = mode
    kernel.mode.cache_clear()


def ksteps(path: Path, rounds: int) -> None:
    """Chapter 19: the decode step with our kernels against torch's ops (MINISGL_KERNELS=torch),
    fi backend, eager and graph, batch 1 and 64; measured as in steps. Then the profile of fi
    graph with our kernels."""
    prompts = step_prompts()

    def ours(mode: str, max_bs: int) -> Callable[[], dict[int, list[float]]]:
        def measure() -> dict[int, list[float]]:
            set_kernels(mode)
            return llm_step_times(path, prompts, attention_backend="fi",
                                  cuda_graph_max_bs=max_bs)
        return measure

    medians = step_rounds({"fi eager, torch ops": ours("torch", 0),
                           "fi eager, ours": ours("auto", 0),
                           "fi graph, torch ops": ours("torch", 64),
                           "fi graph, ours": ours("auto", 64)}, rounds, "kernel steps")
    set_kernels("auto")
    say(f"decode step (ms), {path.name}, bfloat16, prompts of 128 tokens, --attn fi; median of "
        f"{2 * rounds} measurements, each the mean of {STEPS} steps")
    say(f"  {'':<20} {'batch 1':>9} {'batch 64':>9}")
    for name, (a, b) in medians.items():
        say(f"  {name:<20} {a:9.2f} {b:9.2f}")
    profile_steps(path, prompts[64], graph_only=True)


def profile_steps(path: Path, prompts: list[list[int]], graph_only: bool = False) -> None:
    """torch.profiler over 16 decode steps at batch 64, fi eager and fi graph: GPU time by kernel
    and the wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    for name, max_bs in (("fi eager", 0), ("fi graph", 64))[graph_only:]:
        with step_llm(path, attention_backend="fi", cuda_graph_max_bs=max_bs) as llm:
            llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm
            params = SamplingParams(max_tokens=17, ignore_eos=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                wall = wall_s(lambda: llm.generate(prompts, params))  # noqa: B023
        # kernels only: an operator row (aten::mm) repeats the device time of its kernels
        events, gpu_total = by_gpu_time(
            [e for e in prof.key_averages() if not e.key.startswith("aten::")],
            lambda e: e.self_device_time_total)
        say(f"profile {name}, batch 64, 1 prefill + 16 decode steps: wall {wall * 1e3:.1f} ms "
            f"(profiler on), GPU busy {gpu_total:.1f} ms")
        for e in events[:8]:
            say(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d} calls  {e.key[:90]}")


def by_gpu_time(events: list[Any], gpu_us_of: Callable[[Any], float]) -> tuple[list[Any], float]:
    """The profiler's rows that took GPU time, most first, and the ms they took in all."""
    kept = sorted((e for e in events if gpu_us_of(e) > 0), key=lambda e: -gpu_us_of(e))
    return kept, sum(gpu_us_of(e) for e in kept) / 1e3


def gpu_us(fn: Callable[[], object], calls: int = 50) -> tuple[float, float]:
    """Microseconds per call: (GPU time, from a CUDA graph of `calls` calls replayed, so no host
    work shows; eager time, CUDA events around `calls` back-to-back calls, so the host's
    per-call work shows when it exceeds the kernel's)."""
    return graph_ms(fn, calls) * 1e3, cuda_ms(fn, calls=calls, repeats=1).median * 1e3


def kernels() -> None:
    """Chapter 19: our CUDA kernels compiled by nvcc for this GPU against the torch ops they
    replace, timed in turns, 21 rounds of 50 calls each, medians, and the bandwidth they reach."""
    from minisgl.kernel import cuda

    t0 = time.perf_counter()
    cuda.load(False)
    sm = "".join(map(str, torch.cuda.get_device_capability()))
    say(f"kernels: built with nvcc for sm{sm} in {time.perf_counter() - t0:.1f} s")
    say("kernel times, bfloat16, microseconds per call, ours and torch's in turns, medians of 21 "
        "rounds of 50 calls: GPU time (the calls in a CUDA graph) with GB/s = bytes the op must "
        "move / GPU time (H200: 4800 GB/s on paper), and eager time (back-to-back launches: "
        "the host's cost per call)")
    say(f"  {'':<26} {'T':>5} {'ours':>7} {'torch':>7} {'ratio':>6} {'GB/s':>5} {'GB/s':>5} "
        f"{'eager':>6} {'eager':>6}")
    for t in (1, 64, 4096):
        for name, (ours, ref, nbytes) in kernel_cases(torch.bfloat16, t).items():
            a, b = [], []
            for _ in range(21):
                a.append(gpu_us(ours))
                b.append(gpu_us(ref))
            (ga, ea), (gb, eb) = ([statistics.median(x) for x in zip(*m)] for m in (a, b))
            say(f"  {name:<26} {t:>5} {ga:7.2f} {gb:7.2f} {gb / ga:5.2f}x "
                f"{nbytes / ga / 1e3:5.0f} {nbytes / gb / 1e3:5.0f} {ea:6.1f} {eb:6.1f}")
        torch.cuda.empty_cache()


def sampler() -> None:
    """Chapter 21: the draw at temperature 0.6 with no top-k or top-p, on Qwen3's vocabulary
    (151,936), at batch 1, 64 and 256: chapter 6's sorted draw (sample_from_probs) against the
    draw without a sort (sample_without_cut), the softmax before them not timed; then from the
    logits, softmax included: softmax + that draw against our one-pass kernel (cuda.sample);
    then with a cut, top-k 20 and top-p 0.95, from the logits: softmax + the
    sorted draw against the selection of the 20 best (sample_top_k). Median of 50 calls each
    after 5 warm-up calls, CUDA events."""
    from minisgl.engine.sample import sample_from_probs, sample_top_k, sample_without_cut
    from minisgl.kernel import cuda

    g = torch.Generator("cuda").manual_seed(0)
    say("sampler: temperature 0.6, vocabulary 151936, float32; ms per draw of one token per "
        "row: sorted / without a sort (from probabilities), then softmax + without a sort / "
        "our kernel (from logits)")

    def ms(fn: Callable[[], object]) -> float:
        return cuda_ms(fn, repeats=50, warmup=5).median

    for bs in (1, 64, 256):
        logits = torch.randn(bs, 151936, device="cuda", generator=g) * 3
        probs = torch.softmax(logits / 0.6, dim=-1)
        temps = torch.full((bs,), 0.6, device="cuda")
        old = ms(lambda p=probs: sample_from_probs(p, None, None, g))
        new = ms(lambda p=probs: sample_without_cut(p, g))
        two = ms(lambda x=logits, t=temps: sample_without_cut(
            torch.softmax(x / t[:, None], dim=-1), g))
        one = ms(lambda x=logits, t=temps: cuda.sample(x, t, 0, 1))
        say(f"  batch {bs:3d}: sorted {old:7.3f} ms, without a sort {new:7.3f} ms "
            f"({old / new:.1f}x); softmax + draw {two:7.3f} ms, our kernel {one:7.3f} ms "
            f"({two / one:.1f}x)")
        ks, ps = torch.full((bs,), 20, device="cuda"), torch.full((bs,), 0.95, device="cuda")
        cut = ms(lambda x=logits, t=temps, k=ks, p=ps: sample_from_probs(
            torch.softmax(x / t[:, None], dim=-1), k, p, g))
        pick = ms(lambda x=logits, t=temps, k=ks, p=ps: sample_top_k(x, t, k, 20, p, g))
        say(f"  batch {bs:3d}, top-k 20, top-p 0.95: softmax + sorted {cut:7.3f} ms, "
            f"selection of 20 {pick:7.3f} ms ({cut / pick:.1f}x)")


def moe(reps: int) -> None:
    """Chapter 20: one Qwen3-30B-A3B layer, bfloat16, the torch backend (a loop over experts)
    and the Triton fused MoE at 1 to 1024 tokens, median of `reps` calls after 5 warm-up calls,
    CUDA events; then where the triton layer's time goes at one token."""
    from minisgl.moe import create_moe_backend

    shape, dtype = MOE_SHAPE, torch.bfloat16
    backends = {name: create_moe_backend(name, torch.device("cuda")) for name in ("torch",
                                                                                   "triton")}
    say(f"moe: hidden {shape['hidden']}, {shape['experts']} experts, top {shape['top_k']}, "
        f"moe_intermediate {shape['inter']}, random weights")
    say(f"moe layer time (ms), bfloat16, median of {reps} warm calls (CUDA events); weights: "
        "bytes of the experts the tokens chose")
    say(f"  {'tokens':>6} {'experts hit':>11} {'weights MB':>10} {'torch':>9} {'triton':>9} "
        f"{'torch/triton':>12} {'triton GB/s':>11}")
    for n in (1, 8, 64, 256, 1024):
        layer = moe_layer(n, **shape, dtype=dtype, device="cuda", seed=n)
        hit = int(layer[3].topk(shape["top_k"], dim=-1).indices.unique().numel())
        mb = hit * 3 * shape["hidden"] * shape["inter"] * dtype.itemsize / 1e6
        ms = {b: cuda_ms(lambda b=b, layer=layer: backends[b].forward(
                  *layer, shape["top_k"], True), repeats=reps, warmup=5).median
              for b in ("torch", "triton")}
        say(f"  {n:6d} {hit:11d} {mb:10.1f} {ms['torch']:9.3f} {ms['triton']:9.3f} "
            f"{ms['torch'] / ms['triton']:11.1f}x {mb / ms['triton']:11.0f}")
    moe_profile(backends, shape)


def moe_profile(backends: dict[str, Any], shape: dict[str, int], tokens: int = 1) -> None:
    """Where the triton layer's time goes at a few tokens: the layer replayed from a CUDA graph
    (no host work), then a profile of 20 eager calls, kernels ranked by GPU time."""
    layer = moe_layer(tokens, **shape, dtype=torch.bfloat16, device="cuda", seed=tokens)
    run = {b: (lambda b=b: backends[b].forward(*layer, shape["top_k"], True)) for b in backends}
    for name, fn in run.items():
        try:
            for _ in range(3):
                fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            replayed = cuda_ms(graph.replay, repeats=50, warmup=5).median
            eager = cuda_ms(fn, repeats=50, warmup=5).median
            say(f"moe {name} layer at {tokens} token(s), replayed from a CUDA graph: "
                f"{replayed:.3f} ms (eager: {eager:.3f} ms)")
        except Exception as exc:  # noqa: BLE001 (the torch loop reads the host: not capturable)
            say(f"moe {name} layer: no CUDA graph ({type(exc).__name__})")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                              torch.profiler.ProfilerActivity.CPU])
    with prof:
        for _ in range(20):
            run["triton"]()
        torch.cuda.synchronize()
    events, busy = by_gpu_time(
        [e for e in prof.key_averages() if e.device_type.name == "CUDA"],
        lambda e: e.device_time_total)
    say(f"profile moe triton, {tokens} token(s), 20 eager calls: GPU busy {busy:.2f} ms, i.e. "
        f"{busy / 20:.3f} ms per call")
    for e in events[:10]:
        say(f"  {e.device_time_total / 1e3:8.3f} ms {e.count:5d} calls  {e.key[:80]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("benches", nargs="+",
                        choices=["speed", "steps", "ksteps", "kernels", "sampler", "moe"])
    parser.add_argument("--model", type=Path,
                        help="a Qwen3-0.6B-shaped model, bfloat16 (speed, steps, ksteps)")
    parser.add_argument("--attn", default="fi", help="speed: our attention backend")
    parser.add_argument("--requests", type=int, default=64, help="speed: how many")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds (speed, steps, ksteps); moe: max(20, 4 x this) calls")
    parser.add_argument("--no-cb", action="store_true", help="speed: skip HF continuous batching")
    args = parser.parse_args()
    if args.model is None and {"speed", "steps", "ksteps"} & set(args.benches):
        parser.error("speed, steps and ksteps need --model")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script is for a GPU machine")
    say(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; date {datetime.date.today()}")
    for bench in args.benches:
        if bench == "speed":
            speed(args.model, args.requests, args.rounds, not args.no_cb, args.attn)
        elif bench == "steps":
            steps(args.model, args.rounds)
        elif bench == "ksteps":
            ksteps(args.model, args.rounds)
        elif bench == "kernels":
            kernels()
        elif bench == "sampler":
            sampler()
        elif bench == "moe":
            moe(reps=max(20, 4 * args.rounds))


if __name__ == "__main__":
    main()
