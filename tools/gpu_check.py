"""GPU checks in one run (chapters 6, 11, 16-20): the Engine and the stage-2 LLM on CUDA against HF
(with CUDA graphs and our kernels on), a tensor-parallel group of one over NCCL, the FlashInfer
backend against the torch backend, graph replay against eager, our CUDA kernels against torch's
ops, decode step times with a profile, a speed comparison with HF on a Qwen3-0.6B-shaped model,
and the Triton MoE against the torch MoE (one Qwen3-30B-A3B layer timed, and a few of its layers
generating end to end).

    python tools/gpu_check.py stage1 align bf16     # on a machine with CUDA and models/tiny-* made
    python tools/gpu_check.py speed --model /tmp/q06 # a model made by tools/models.py random
    python tools/gpu_check.py moe --moe-model /tmp/moe  # made here if missing (qwen3-moe preset)
    python tools/gpu_check.py moe --device cpu       # the same check, tiny, Triton interpreted

Prints one line per check and a summary; exits 1 if any check fails. CI has no GPU and never
runs this; the book records its output with the machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "chapters" / "ch06_engine")]

import torch  # noqa: E402
import transformers  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine import Engine, EngineConfig  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

from skeleton import HandBatcher  # noqa: E402

MODELS = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 72)), [11, 12]]
BF16_TOL = 2e-2  # relative logits error allowed in bfloat16


def hf_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], list]:
    x = torch.tensor([ids], device="cuda")
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [t[0].float() for t in out.logits]


def spy_logits(engine: Engine) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    sample = engine.sampler.sample
    engine.sampler.sample = lambda logits, args: (seen.append(logits.float().clone()),  # type: ignore
                                                  sample(logits, args))[1]
    return seen


def check_stage1(name: str) -> list[str]:
    """Chapter 6's Engine with hand-filled batches, float32, four requests in one batch."""
    path = ROOT / "models" / name
    engine = Engine(EngineConfig(str(path), dtype=torch.float32, num_page_override=256,
                                 max_running_req=8, page_size=4, attention_backend="torch"))
    assert engine.device.type == "cuda", engine.device
    seen = spy_logits(engine)
    ours = HandBatcher(engine).generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    engine.shutdown()
    hf = hf_model(path, torch.float32)
    lines = []
    for i, (ids, tokens) in enumerate(zip(PROMPTS, ours)):
        ref, ref_logits = hf_greedy(hf, ids, 16)
        worst = max(float((s[i] - r).abs().max()) for s, r in zip(seen, ref_logits))
        ok = tokens == ref and worst <= 1e-3
        lines.append(f"{'ok  ' if ok else 'FAIL'} stage1 {name} request {i} ({len(ids)} tokens, "
                     f"in a batch of 4): same 16 tokens as HF {tokens == ref}, "
                     f"max |dlogit| {worst:.1e}")
    return lines


def shared_prefix_prompts(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (8 + i % 3,), generator=g).tolist() for i in range(n)]


def make_llm(path: Path, overlap: bool, **config) -> LLM:
    """The torch backend unless said otherwise (FlashInfer has no float32 kernels); CUDA graphs
    on, as by default (chapter 18)."""
    os.environ["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "0" if overlap else "1"
    config.setdefault("attention_backend", "torch")
    llm = LLM(str(path), **config)
    assert llm.device.type == "cuda" and llm.overlap == overlap
    assert isinstance(llm.stream, torch.cuda.Stream)
    return llm


def check_align(name: str) -> list[str]:
    """The stage-2 LLM on CUDA, float32: 8 requests with a shared prefix, overlap on and off,
    radix and naive, page size 4, two running at a time: the same tokens as HF."""
    path = ROOT / "models" / name
    prompts = shared_prefix_prompts(8, 64, seed=0)
    hf = hf_model(path, torch.float32)
    refs = [hf_greedy(hf, p, 12)[0] for p in prompts]
    lines = []
    for overlap in (True, False):
        for cache_type, mrr in (("radix", 16), ("naive", 2)):
            llm = make_llm(path, overlap, dtype=torch.float32, cache_type=cache_type,
                           page_size=4, max_running_req=mrr, num_page_override=512)
            out = [o["token_ids"] for o in llm.generate(
                prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
            computed = llm.stats.prefill_tokens
            llm.shutdown()
            same = sum(o == r for o, r in zip(out, refs))
            lines.append(f"{'ok  ' if same == 8 else 'FAIL'} align {name} float32 overlap "
                         f"{'on ' if overlap else 'off'} {cache_type} max_running_req {mrr}: "
                         f"{same}/8 equal HF, {computed} prompt tokens computed")
    return lines


def check_tp1() -> list[str]:
    """Chapter 16 on one GPU: a tensor-parallel group of one over NCCL (the GPU collectives)
    with its gloo half (the host's), the communicator's calls through both, and the offline LLM
    joining that group: the same tokens as HF. Two ranks need two GPUs (NCCL refuses two ranks
    on one device): that run is issue 11's."""
    import tempfile

    import torch.distributed as dist

    from minisgl.distributed import (
        DistributedInfo,
        all_gather,
        all_reduce,
        broadcast,
        comm,
        init_distributed,
    )

    rendezvous = f"file://{tempfile.mkdtemp()}/rendezvous"
    init_distributed(DistributedInfo(0, 1), torch.device("cuda", 0), rendezvous)
    x = torch.arange(6, dtype=torch.bfloat16, device="cuda").view(2, 3)
    host = torch.tensor([5, -5])
    ok = (dist.get_backend() == "nccl" and dist.get_backend(comm._HOST_GROUP) == "gloo"
          and torch.equal(all_reduce(x.clone()), x) and all_gather(x).shape == (1, 2, 3)
          and torch.equal(broadcast(x.clone()), x)
          and all_reduce(host, dist.ReduceOp.MIN).tolist() == [5, -5])
    lines = [f"{'ok  ' if ok else 'FAIL'} tp1 group of one: device collectives over "
             f"{dist.get_backend()}, host collectives over {dist.get_backend(comm._HOST_GROUP)}"]
    for name in MODELS:
        path = ROOT / "models" / name
        llm = LLM(str(path), dtype=torch.float32, num_page_override=512,
                  tp_info=DistributedInfo(0, 1), dist_init=rendezvous)
        out = [o["token_ids"] for o in llm.generate(
            PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
        llm.shutdown()  # leaves the group: the next LLM joins it again
        init_distributed(DistributedInfo(0, 1), torch.device("cuda", 0),
                         f"file://{tempfile.mkdtemp()}/rendezvous")
        hf = hf_model(path, torch.float32)
        same = sum(o == hf_greedy(hf, p, 12)[0] for o, p in zip(out, PROMPTS))
        lines.append(f"{'ok  ' if same == len(PROMPTS) else 'FAIL'} tp1 {name} float32 in the "
                     f"NCCL group: {same}/{len(PROMPTS)} equal HF")
    comm.destroy_distributed()
    return lines


def check_bf16(path: Path, label: str) -> list[str]:
    """bfloat16 on CUDA: our logits at every step, teacher-forced on our own tokens, against
    HF's logits for the same tokens (HF bfloat16, and HF float32 for scale)."""
    ids = shared_prefix_prompts(1, 40, seed=1)[0]
    llm = make_llm(path, True, dtype=torch.bfloat16, num_page_override=256)
    seen = spy_logits(llm.engine)
    tokens = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]["token_ids"]
    llm.shutdown()
    x = torch.tensor([ids + tokens[:-1]], device="cuda")
    refs = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = hf_model(path, dtype)
        with torch.no_grad():
            refs[dtype] = hf(x).logits[0, len(ids) - 1 :].float()
        del hf
    ours = [s[0] for s in seen]
    hf_bf16 = list(refs[torch.bfloat16])
    lines = []
    for what, a, b, limit in (("ours bf16 vs HF bf16", ours, hf_bf16, BF16_TOL),
                              ("ours bf16 vs HF fp32", ours, refs[torch.float32], None),
                              ("HF bf16 vs HF fp32 (baseline)", hf_bf16, refs[torch.float32],
                               None)):
        errs = [float((p - r).norm() / r.norm()) for p, r in zip(a, b)]
        ok = limit is None or max(errs) <= limit
        mark = "info" if limit is None else "ok  " if ok else "FAIL"
        lines.append(f"{mark} bf16 {label}: {what}, 16 steps teacher-forced: "
                     f"max relative error {max(errs):.2e}, median {statistics.median(errs):.2e}"
                     + ("" if limit is None else f" (limit {limit:g})"))
    return lines


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def speed_workload(path: Path, n: int) -> tuple[list[list[int]], list[int]]:
    """Issue 5's workload: n prompts of random ids, input and output lengths uniform in
    100..512, seed 0; the prompts and their output lengths."""
    g = torch.Generator().manual_seed(0)
    in_lens = torch.randint(100, 513, (n,), generator=g).tolist()
    out_lens = torch.randint(100, 513, (n,), generator=g).tolist()
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in in_lens], out_lens


def check_speed(path: Path, n: int, rounds: int, cb: bool, attn: str) -> list[str]:
    """n requests, input and output lengths uniform in 100..512 (seed 0), bfloat16: our
    LLM.generate (overlap on and off) and HF's padded generate, each run `rounds` times in
    turns after a warm-up run of each, medians reported; HF continuous batching once."""
    prompts, out_lens = speed_workload(path, n)
    in_lens = [len(p) for p in prompts]
    useful = sum(out_lens)
    lines = [f"speed workload: {n} requests, prompts {sum(in_lens)} tokens, outputs {useful} "
             f"tokens (max {max(out_lens)}), bfloat16, {path.name}; median of {rounds} rounds "
             f"taken in turns after one warm-up run each"]
    print(lines[0], flush=True)

    def row(label: str, times: list[float], extra: str = "") -> None:
        sec = statistics.median(times)
        lines.append(f"  {label:<42} {sec:7.1f} s  {useful / sec:8.0f} output tok/s"
                     f" (min {min(times):.1f} s, max {max(times):.1f} s)" + extra)
        print(lines[-1], flush=True)

    # one LLM (one Engine per process), overlap switched per run; KV room for every request;
    # no prefix cache, so that every run computes every prompt again, as HF does
    llm = make_llm(path, True, dtype=torch.bfloat16, max_running_req=n, cache_type="naive",
                   num_page_override=sum(in_lens) + useful + 1024, attention_backend=attn)
    lines.append(f"  ours: --attn {attn}, graphs for batch sizes {llm.engine.graph_runner.sizes}")
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in out_lens]
    steps: dict[bool, list[float]] = {True: [], False: []}

    def ours(overlap: bool) -> float:
        llm.overlap = overlap
        before = llm.stats.decode_batches
        seconds = timed(lambda: llm.generate(prompts, params))
        steps[overlap].append(seconds / (llm.stats.decode_batches - before))
        return seconds

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    hf.eval()
    gc = transformers.GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                       max_new_tokens=max(out_lens))
    # padded generate: all requests in one batch, left padding, every row runs to the longest
    width = max(in_lens)
    x = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    x, mask = x.cuda(), mask.cuda()

    def hf_padded() -> float:
        return timed(lambda: hf.generate(x, attention_mask=mask, generation_config=gc))

    runs = {"ours LLM.generate, overlap on": lambda: ours(True),
            "ours LLM.generate, overlap off": lambda: ours(False),
            "HF generate, one left-padded batch": hf_padded}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds + 1):  # round 0 warms every kernel and shape up; not counted
        for name, run in runs.items():
            seconds = run()
            print(f"    round {i} {name}: {seconds:.1f} s", flush=True)
            if i:
                times[name].append(seconds)
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
    llm.shutdown()
    torch.cuda.empty_cache()

    def hf_cb(reqs: list[list[int]], lens: list[int], deadline: float) -> None:
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

    if not cb:
        return lines
    try:
        hf_cb(prompts[:4], [8] * 4, time.perf_counter() + 60)  # warm-up
        seconds = timed(lambda: hf_cb(prompts, out_lens, time.perf_counter() + 150))
        row("HF continuous batching (once)", [seconds])
    except Exception as exc:  # noqa: BLE001 (report what failed, keep the other rows)
        lines.append(f"  HF continuous batching failed: {type(exc).__name__}: {exc}"[:300])
        print(lines[-1], flush=True)
    return lines


def relative_errors(got: list[list[int]], ref: list[list[int]], logits: list[torch.Tensor],
                     ref_logits: list[torch.Tensor]) -> list[float]:
    """Per step, the largest |a - b| / |b| (norms over the vocabulary) over the rows whose tokens
    so far are the reference's (teacher-forced: the same inputs); stops at a shape change."""
    errs = []
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        rows = [i for i in range(len(got)) if got[i][:step] == ref[i][:step]]
        if a.shape != b.shape or not rows:
            break
        errs.append(max(float((a[i] - b[i]).norm() / b[i].norm()) for i in rows))
    return errs


def _generate(path: Path, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
              spy: Callable | None = None, **config) -> tuple[list[list[int]], list, float]:
    """Tokens, the logits of every step, and the seconds of the first generate (JIT included)."""
    llm = make_llm(path, config.pop("overlap", True), **config)
    seen = spy_logits(llm.engine)
    if spy:
        spy(llm)
    out: list = []
    seconds = timed(lambda: out.extend(llm.generate(prompts, params)))
    llm.shutdown()
    return [o["token_ids"] for o in out], seen, seconds


def check_fi(path: Path) -> list[str]:
    """Chapter 17: our fi backend on the real FlashInfer against our torch backend, bfloat16, on
    the Qwen3-0.6B shape (FlashInfer has no float32 kernels, nor head_dim 16 or 32, so the tiny
    models cannot run it): greedy tokens and teacher-forced relative logits error, page size 1
    and 4, overlap on and off, graphs off (the backends alone)."""
    import flashinfer

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 150000, (n,), generator=g).tolist() for n in (37, 120, 300, 511)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    common = dict(dtype=torch.bfloat16, num_page_override=8192, max_running_req=16,
                  cache_type="naive", cuda_graph_max_bs=0)
    ref, ref_logits, _ = _generate(path, prompts, params, attention_backend="torch", **common)
    lines = [f"info fi: flashinfer {flashinfer.__version__}, {path.name}, bfloat16, 4 prompts "
             "(37, 120, 300, 511 tokens), 32 tokens each"]
    for page_size, overlap in ((1, True), (4, True), (1, False)):
        got, logits, first = _generate(path, prompts, params, attention_backend="fi",
                                       page_size=page_size, overlap=overlap, **common)
        errs = relative_errors(got, ref, logits, ref_logits)
        ok = max(errs) <= BF16_TOL
        lines.append(f"{'ok  ' if ok else 'FAIL'} fi vs torch backend, page size {page_size}, "
                     f"overlap {'on' if overlap else 'off'}: relative logits error max "
                     f"{max(errs):.2e} (median {statistics.median(errs):.2e}) over {len(errs)} "
                     f"teacher-forced steps (limit {BF16_TOL:g}); "
                     f"{sum(a == b for a, b in zip(got, ref))}/4 requests give all 32 tokens "
                     f"alike; first generate {first:.1f} s (FlashInfer JIT included)")
    return lines


GRAPH_LENS = (5, 17, 1, 30, 9, 12, 3, 22)  # 8 requests that stop one after another


def _graph_workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in GRAPH_LENS]
    return prompts, [SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True) for i in range(8)]


def check_graph(q06: Path | None) -> list[str]:
    """Chapter 18: real CUDA graph replay against eager. 8 requests stopping one after another
    make decode batches of every size 8..1; graphs up to 6 replay sizes 1, 2, 4, 6 and pad 3
    and 5; 7 and 8 run eagerly. Tiny models in float32 (torch backend), and fi on the
    Qwen3-0.6B shape in bfloat16."""
    from minisgl.engine.graph import GraphRunner

    replays: list[tuple[int, int]] = []
    replay = GraphRunner.replay

    def spy(self: GraphRunner, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        replays.append((batch.size, batch.padded_size))
        return replay(self, batch)

    GraphRunner.replay = spy  # type: ignore[method-assign]
    want = {(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (6, 6)}
    runs = [(ROOT / "models" / name, torch.float32, "torch") for name in MODELS]
    if q06:
        runs.append((q06, torch.bfloat16, "fi"))
    lines = []
    for path, dtype, attn in runs:
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
        prompts, params = _graph_workload(vocab)
        common = dict(dtype=dtype, num_page_override=4096, max_seq_len_override=512,
                      attention_backend=attn)
        eager, eager_logits, _ = _generate(path, prompts, params, cuda_graph_max_bs=0, **common)
        replays.clear()
        graph, logits, _ = _generate(path, prompts, params, cuda_graph_max_bs=6, **common)
        # batches shrink as requests stop: rows are compared while both runs are step for step
        errs = [float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())
                for a, b in zip(logits, eager_logits) if a.shape == b.shape] or [float("nan")]
        sizes_ok = want <= set(replays)
        ok = graph == eager and sizes_ok
        same = sum(a == b for a, b in zip(graph, eager))
        lines.append(f"{'ok  ' if ok else 'FAIL'} graph {path.name} {str(dtype)[6:]} --attn "
                     f"{attn}: replay gives eager's tokens for {same}/8 requests; (size, "
                     f"padded) replayed {sorted(set(replays))}; relative logits error vs eager "
                     f"max {max(errs):.1e}")
    GraphRunner.replay = replay  # type: ignore[method-assign]
    return lines


STEPS = 64  # decode steps in one step-time measurement


def _step_prompts() -> dict[int, list[list[int]]]:
    """Batches of 1 and 64 prompts of 128 random ids (seed 0), for the step-time checks."""
    g = torch.Generator().manual_seed(0)
    return {bs: [torch.randint(10, 150000, (128,), generator=g).tolist() for _ in range(bs)]
            for bs in (1, 64)}


def _ms_per_step(run: Callable[[int], object]) -> float:
    """The mean decode step (ms) of run(k), which generates k tokens: the time of STEPS + 1
    tokens less the time of 1 (the prefill), over STEPS."""
    one, many = timed(lambda: run(1)), timed(lambda: run(STEPS + 1))
    return (many - one) / STEPS * 1e3


def _llm_step_times(path: Path, prompts: dict[int, list[list[int]]],
                    **config: object) -> dict[int, list[float]]:
    """One LLM (bfloat16, overlap on, `config`): two step-time measurements per batch size."""
    llm = make_llm(path, True, dtype=torch.bfloat16, max_running_req=64, cache_type="naive",
                   num_page_override=64 * 256, max_seq_len_override=256, **config)
    times = {bs: [_ms_per_step(lambda k, ps=ps: llm.generate(
        ps, SamplingParams(max_tokens=k, ignore_eos=True))) for _ in range(2)]
        for bs, ps in prompts.items()}
    llm.shutdown()
    return times


def check_steps(path: Path, rounds: int) -> list[str]:
    """Decode step time on the Qwen3-0.6B shape, bfloat16, prompts of 128 tokens: eager vs graph
    and torch vs fi, at batch 1 and 64, HF generate beside. A figure is the median over
    `rounds` rounds (configurations in turns) of two measurements, each the mean of 64 decode
    steps: (time of 65 tokens - time of 1 token) / 64. Then a profile of 16 steps at batch 64."""
    prompts = _step_prompts()
    configs = {"torch eager": ("torch", 0), "torch graph": ("torch", 64),
               "fi eager": ("fi", 0), "fi graph": ("fi", 64)}
    times: dict[tuple[str, int], list[float]] = {(c, bs): [] for c in [*configs, "HF"]
                                                 for bs in prompts}
    hf = hf_model(path, torch.bfloat16)
    for i in range(rounds + 1):  # round 0 warms up and is not counted
        for name, (attn, max_bs) in configs.items():
            measured = _llm_step_times(path, prompts, attention_backend=attn,
                                       cuda_graph_max_bs=max_bs)
            for bs, ms in measured.items():
                times[(name, bs)] += ms if i else []
        for bs, ps in prompts.items():
            x = torch.tensor(ps, device="cuda")
            for _ in range(2):
                ms = _ms_per_step(lambda k, x=x: hf.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                    do_sample=False))
                if i:
                    times[("HF", bs)].append(ms)
        print(f"    steps round {i} done", flush=True)
    torch.cuda.empty_cache()
    lines = [f"info decode step (ms), {path.name}, bfloat16, prompts of 128 tokens; median of "
             f"{2 * rounds} measurements, each the mean of {STEPS} steps"]
    lines.append(f"info   {'':<12} {'batch 1':>9} {'batch 64':>9}")
    hf1 = statistics.median(times[("HF", 1)])
    for name in [*configs, "HF"]:
        a, b = (statistics.median(times[(name, bs)]) for bs in (1, 64))
        lines.append(f"info   {name:<12} {a:9.2f} {b:9.2f}   (HF / this at batch 1: "
                     f"{hf1 / a:.1f}x)")
    lines += profile_steps(path, prompts[64])
    return lines


def _set_kernels(mode: str) -> None:
    """MINISGL_KERNELS for the LLMs made next in this process (chapter 19)."""
    from minisgl import kernel

    os.environ["MINISGL_KERNELS"] = mode
    kernel.mode.cache_clear()


def _kernel_cases(dtype: torch.dtype, t: int) -> dict[str, tuple[Callable, Callable, int]]:
    """Each of our kernels and the torch ops it replaces, on the Qwen3-0.6B shapes for t tokens:
    name -> (ours, torch's, bytes the op must move at least)."""
    from minisgl.kernel import cuda, reference

    hidden, hq, hk, d, inter, vocab = 1024, 16, 8, 128, 3072, 151936
    size = torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cuda").manual_seed(t)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    x, r, w = rand(t, hidden), rand(t, hidden), rand(hidden)
    qkv, wd = rand(t, (hq + 2 * hk) * d), rand(d)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
    positions = torch.randint(0, 4096, (t,), generator=g, device="cuda", dtype=torch.int32)
    angles = torch.outer(torch.arange(4096.0, device="cuda"),
                         1e6 ** (-torch.arange(0, d, 2, device="cuda") / d))
    table = torch.cat([angles.cos(), angles.sin()], -1)
    cos, sin = reference.rope_cos_sin(positions, table, dtype)  # once per forward, not timed
    gate_up = rand(t, 2 * inter)
    slots = 16384
    k_cache, v_cache = rand(slots, hk, d), rand(slots, hk, d)
    kk, vv = rand(t, hk, d), qkv[:, (hq + hk) * d:].view(t, hk, d)
    loc = torch.randperm(slots, device="cuda")[:t].to(torch.int32)
    emb, ids = rand(vocab, hidden), torch.randint(0, vocab, (t,), device="cuda",
                                                  dtype=torch.int32)
    qn = q.view(t, hq, d)
    half = emb[vocab // 2:].contiguous()  # rank 1 of 2 (chapter 16): rows [vocab / 2, vocab)

    def masked() -> torch.Tensor:  # torch's ops for a rank's range, as kernel.embedding has them
        local = ids - vocab // 2
        mine = (local >= 0) & (local < len(half))
        rows = reference.embedding(torch.where(mine, local, 0), half)
        return rows * mine.unsqueeze(-1).to(rows.dtype)

    return {
        "rms_norm [T,1024]": (lambda: cuda.rms_norm(x, w, 1e-6),
                              lambda: reference.rms_norm(x, w, 1e-6), 2 * t * hidden * size),
        "add+rms_norm [T,1024]": (lambda: cuda.fused_add_rms_norm(x, r, w, 1e-6),
                                  lambda: reference.fused_add_rms_norm(x, r, w, 1e-6),
                                  4 * t * hidden * size),
        "q_norm [T,16,128] in qkv": (lambda: cuda.rms_norm(qn, wd, 1e-6),
                                     lambda: reference.rms_norm(qn, wd, 1e-6),
                                     2 * t * hq * d * size),
        "rope q,k [T,24,128]": (lambda: cuda.rope(positions, q, k, table, d),
                                lambda: reference.apply_rope_with(q, k, cos, sin),
                                2 * t * (hq + hk) * d * size),
        "silu_and_mul [T,6144]": (lambda: cuda.silu_and_mul(gate_up),
                                  lambda: reference.silu_and_mul(gate_up), 3 * t * inter * size),
        "store_kv [T,8,128]": (lambda: cuda.store_cache(k_cache, v_cache, loc, kk, vv),
                               lambda: reference.store_cache(k_cache, v_cache, loc, kk, vv),
                               4 * t * hk * d * size),
        "embedding [T] of 151936": (lambda: cuda.embedding(ids, emb),
                                    lambda: reference.embedding(ids, emb),
                                    2 * t * hidden * size),
        "embedding, half the vocab": (lambda: cuda.embedding(ids, half, vocab // 2), masked,
                                      2 * t * hidden * size),
    }


def _gpu_time(fn: Callable[[], object], calls: int = 50) -> tuple[float, float]:
    """Microseconds per call: (GPU time, from a CUDA graph of `calls` calls replayed, so no host
    work shows; eager time, CUDA events around `calls` back-to-back calls, so the host's
    per-call work shows when it exceeds the kernel's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    gpu = start.elapsed_time(end) * 1e3 / calls
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return gpu, start.elapsed_time(end) * 1e3 / calls


def check_sampler() -> list[str]:
    """Chapter 21: the draw at temperature 0.6 with no top-k or top-p, on Qwen3's vocabulary
    (151,936), at batch 1, 64 and 256: chapter 6's sorted draw (sample_from_probs) against the
    draw without a sort (sample_without_cut), the softmax before them not timed; then from the
    logits, softmax included: softmax + that draw against our one-pass kernel (cuda.sample).
    Median of 50 calls each after a warm-up, CUDA events. Then both draws' frequencies on the
    GPU against the float64 softmax."""
    from minisgl.engine.sample import sample_from_probs, sample_without_cut
    from minisgl.kernel import cuda

    g = torch.Generator("cuda").manual_seed(0)
    lines = ["info sampler: temperature 0.6, vocabulary 151936, float32; ms per draw of one token"
             " per row: sorted / without a sort (from probabilities), then softmax + without a "
             "sort / our kernel (from logits)"]
    for bs in (1, 64, 256):
        logits = torch.randn(bs, 151936, device="cuda", generator=g) * 3
        probs = torch.softmax(logits / 0.6, dim=-1)
        temps = torch.full((bs,), 0.6, device="cuda")
        old = _median_ms(lambda p=probs: sample_from_probs(p, None, None, g), True, 50)
        new = _median_ms(lambda p=probs: sample_without_cut(p, g), True, 50)
        two = _median_ms(lambda x=logits, t=temps: sample_without_cut(
            torch.softmax(x / t[:, None], dim=-1), g), True, 50)
        one = _median_ms(lambda x=logits, t=temps: cuda.sample(x, t, 0, 1), True, 50)
        lines.append(f"info   batch {bs:3d}: sorted {old:7.3f} ms, without a sort {new:7.3f} ms"
                     f" ({old / new:.1f}x); softmax + draw {two:7.3f} ms, our kernel {one:7.3f} "
                     f"ms ({two / one:.1f}x)")
    expected = torch.softmax(torch.tensor([2.0, 1.6, 1.1, 0.9, 0.3, -0.2, -1.0, -3.0],
                                          dtype=torch.float64) / 0.8, dim=-1)
    logits = (expected.log() * 0.8).float().cuda().expand(100_000, 8).contiguous()
    temps = torch.full((100_000,), 0.8, device="cuda")
    draws = {"sampler without a sort": lambda i: sample_without_cut(
                 expected.float().cuda().expand(100_000, 8).contiguous(), g),
             "our sampling kernel": lambda i: cuda.sample(logits, temps, 7, i).long()}
    for name, draw in draws.items():
        counts = sum(torch.bincount(draw(i), minlength=8).double().cpu() for i in range(4))
        exp = expected * 400_000
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        p_value = float(torch.special.gammaincc(torch.tensor(3.5), torch.tensor(chi2 / 2)))
        lines.append(f"{'ok  ' if p_value > 1e-3 else 'FAIL'} {name} on the GPU: 400,000 draws "
                     f"from 8 tokens, chi-square {chi2:.1f} with 7 degrees of freedom, "
                     f"p = {p_value:.3f} (fails below 1e-3)")
    return lines


def check_kernels() -> list[str]:
    """Chapter 19: our CUDA kernels compiled by nvcc for this GPU. Each against the torch ops it
    replaces: equal (float32: to rounding; bfloat16: within two roundings, counted), then timed
    in turns, 21 rounds of 50 calls each, medians, and the bandwidth they reach."""
    from minisgl.kernel import cuda, reference

    t0 = time.perf_counter()
    cuda.load(False)
    sm = "".join(map(str, torch.cuda.get_device_capability()))
    lines = [f"info kernels: built with nvcc for sm{sm} in {time.perf_counter() - t0:.1f} s"]
    # bfloat16: both round twice (normed, then times the weight); sums in another order can
    # flip a rounding, so ours and torch's may be two units in the last place apart
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)):
        for t in (1, 77, 4096):
            for name, (ours, ref, _) in _kernel_cases(dtype, t).items():
                if name.startswith("store_kv"):
                    continue  # it writes the caches: below
                got, want = ours(), ref()
                pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
                bad = [float((a.float() - b.float()).abs().max()) for a, b in pairs
                       if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)]
                same = sum(int((a == b).sum()) for a, b in pairs) / sum(a.numel() for a, _ in pairs)
                lines.append(f"{'FAIL' if bad else 'ok  '} kernel {name} T={t} "
                             f"{str(dtype)[6:]}: {100 * same:.2f}% of elements bit-equal to "
                             "torch's, all within tolerance"
                             + (f" NOT: max |d| {max(bad):.2e}" if bad else ""))
        kc, vc = (torch.randn(16384, 8, 128, device="cuda").to(dtype) for _ in range(2))
        kc2, vc2 = kc.clone(), vc.clone()
        loc = torch.randperm(16384, device="cuda")[:333]  # int64 slots this time
        k, v = (torch.randn(333, 8, 128, device="cuda").to(dtype) for _ in range(2))
        cuda.store_cache(kc, vc, loc, k, v)
        reference.store_cache(kc2, vc2, loc, k, v)
        ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
        lines.append(f"{'ok  ' if ok else 'FAIL'} kernel store_kv T=333 {str(dtype)[6:]}, int64 "
                     "slots: the caches bit-equal to torch's index_put")
    lines.append("info kernel times, bfloat16, microseconds per call, ours and torch's in turns, "
                 "medians of 21 rounds of 50 calls: GPU time (the calls in a CUDA graph) with "
                 "GB/s = bytes the op must move / GPU time (H200: 4800 GB/s on paper), and eager "
                 "time (back-to-back launches: the host's cost per call)")
    lines.append(f"info   {'':<26} {'T':>5} {'ours':>7} {'torch':>7} {'ratio':>6} "
                 f"{'GB/s':>5} {'GB/s':>5} {'eager':>6} {'eager':>6}")
    for t in (1, 64, 4096):
        for name, (ours, ref, nbytes) in _kernel_cases(torch.bfloat16, t).items():
            a, b = [], []
            for _ in range(21):
                a.append(_gpu_time(ours))
                b.append(_gpu_time(ref))
            (ga, ea), (gb, eb) = ([statistics.median(x) for x in zip(*m)] for m in (a, b))
            lines.append(f"info   {name:<26} {t:>5} {ga:7.2f} {gb:7.2f} {gb / ga:5.2f}x "
                         f"{nbytes / ga / 1e3:5.0f} {nbytes / gb / 1e3:5.0f} {ea:6.1f} {eb:6.1f}")
        torch.cuda.empty_cache()
    return lines


def check_kernel_steps(path: Path, rounds: int) -> list[str]:
    """Chapter 19: the decode step with our kernels against torch's ops (MINISGL_KERNELS=torch),
    fi backend, eager and graph, batch 1 and 64; measured as in check_steps. Then the profile of
    fi graph with our kernels."""
    prompts = _step_prompts()
    configs = {"fi eager, torch ops": ("torch", 0), "fi eager, ours": ("auto", 0),
               "fi graph, torch ops": ("torch", 64), "fi graph, ours": ("auto", 64)}
    times: dict[tuple[str, int], list[float]] = {(c, bs): [] for c in configs for bs in prompts}
    for i in range(rounds + 1):  # round 0 warms up and is not counted
        for name, (mode, max_bs) in configs.items():
            _set_kernels(mode)
            measured = _llm_step_times(path, prompts, attention_backend="fi",
                                       cuda_graph_max_bs=max_bs)
            for bs, ms in measured.items():
                times[(name, bs)] += ms if i else []
        print(f"    kernel steps round {i} done", flush=True)
    _set_kernels("auto")
    lines = [f"info decode step (ms), {path.name}, bfloat16, prompts of 128 tokens, --attn fi; "
             f"median of {2 * rounds} measurements, each the mean of {STEPS} steps"]
    lines.append(f"info   {'':<20} {'batch 1':>9} {'batch 64':>9}")
    for name in configs:
        a, b = (statistics.median(times[(name, bs)]) for bs in (1, 64))
        lines.append(f"info   {name:<20} {a:9.2f} {b:9.2f}")
    lines += profile_steps(path, prompts[64], graph_only=True)
    return lines


def profile_steps(path: Path, prompts: list[list[int]], graph_only: bool = False) -> list[str]:
    """torch.profiler over 16 decode steps at batch 64, fi eager and fi graph: GPU time by kernel
    and the wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    lines = []
    for name, max_bs in (("fi eager", 0), ("fi graph", 64))[graph_only:]:
        llm = make_llm(path, True, dtype=torch.bfloat16, attention_backend="fi",
                       cuda_graph_max_bs=max_bs, max_running_req=64, cache_type="naive",
                       num_page_override=64 * 256, max_seq_len_override=256)
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm
        params = SamplingParams(max_tokens=17, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = timed(lambda: llm.generate(prompts, params))  # noqa: B023
        llm.shutdown()
        # kernels only: an operator row (aten::mm) repeats the device time of its kernels
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0
                  and not e.key.startswith("aten::")]
        events.sort(key=lambda e: -e.self_device_time_total)
        gpu_total = sum(e.self_device_time_total for e in events) / 1e3
        lines.append(f"info profile {name}, batch 64, 1 prefill + 16 decode steps: wall "
                     f"{wall * 1e3:.1f} ms (profiler on), GPU busy {gpu_total:.1f} ms")
        for e in events[:8]:
            lines.append(f"info   {e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d} calls  "
                         f"{e.key[:90]}")
    return lines


def check_serve(path: Path, flags: tuple[str, ...] = ()) -> list[str]:
    """`python -m minisgl --attn auto` (and `flags`) on this GPU: its log lines on the backend
    and the graphs, and one streamed chat completion through the openai client; then SIGTERM,
    after which none of its processes may be left."""
    import signal
    import socket
    import subprocess
    import urllib.request

    import openai
    import psutil

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(f"/tmp/serve-{port}.log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"),
                                                      os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "minisgl", "--model", str(path), "--attn", "auto", "--port",
           str(port), "--max-seq-len-override", "4096", *flags]
    start = time.perf_counter()
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    lines = [f"info serve: {' '.join(cmd[1:])}"]
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.perf_counter() - start > 400:
                raise RuntimeError(f"no server: {log.read_text()[-2000:]}")
            time.sleep(1)
        lines.append(f"info serve: ready after {time.perf_counter() - start:.0f} s")
        lines += [f"info serve log: {line.split(': ', 1)[-1]}"
                  for line in log.read_text().splitlines()
                  if "attention:" in line or "graphs" in line and "capturing" not in line]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        t = time.perf_counter()
        chunks = list(client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hello!"}], max_tokens=32,
            temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # random weights pick ids the small tokenizer has no text for: the text may be empty
        ok = chunks[-1].choices[0].finish_reason == "length"
        lines.append(f"{'ok  ' if ok else 'FAIL'} serve: streamed chat completion, "
                     f"{len(chunks)} chunks in {time.perf_counter() - t:.2f} s, finish_reason "
                     f"{chunks[-1].choices[0].finish_reason}; text (random weights) {text[:60]!r}")
    finally:
        try:
            family = psutil.Process(server.pid).children(recursive=True)
        except psutil.NoSuchProcess:  # it died already: the error above says why
            family = []
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            p.kill()
        lines.append(f"{'ok  ' if code == 0 and not alive else 'FAIL'} serve: SIGTERM, exit code "
                     f"{code}; {len(family)} child processes, {len(alive)} of them left running")
    return lines


MOE_SHAPE = dict(hidden=2048, experts=128, top_k=8, inter=768)  # one Qwen3-30B-A3B layer
MOE_TINY = dict(hidden=64, experts=8, top_k=2, inter=32)  # tiny-qwen3-moe's, for --device cpu


def _moe_layer(tokens: int, hidden: int, experts: int, top_k: int, inter: int,
               dtype: torch.dtype, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random x, gate_up [E, 2I, H], down [E, H, I] and router logits, scaled like a trained
    layer's (unit activations in, unit activations out)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    return (x.to(device, dtype), gate_up.to(device, dtype), down.to(device, dtype),
            logits.to(device))


def _median_ms(fn: Callable[[], object], cuda: bool, reps: int) -> float:
    """Median of `reps` timed calls after 5 untimed ones: CUDA events on a GPU, else the clock."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def check_moe(device: str, model: Path | None, reps: int) -> list[str]:
    """Chapter 20. (a) The Triton fused MoE against the torch backend (a loop over experts) on
    one Qwen3-30B-A3B layer, bfloat16 and float32, relative error; (b) that layer timed, both
    backends, at 1 to 1024 tokens; (c) a Qwen3-MoE model generating with each backend, greedy
    tokens compared, logits teacher-forced. `device` cpu runs it all on tiny shapes in Triton's
    interpreter (TRITON_INTERPRET=1, set before the kernel is imported)."""
    from minisgl.moe import create_moe_backend

    cuda = device == "cuda"
    shape = MOE_SHAPE if cuda else MOE_TINY
    backends = {name: create_moe_backend(name, torch.device(device)) for name in ("torch",
                                                                                  "triton")}
    counts = (1, 8, 64, 256, 1024) if cuda else (1, 8, 64)
    lines = [f"info moe: hidden {shape['hidden']}, {shape['experts']} experts, top "
             f"{shape['top_k']}, moe_intermediate {shape['inter']}, random weights, on {device}"]
    for dtype, limit in ((torch.bfloat16, BF16_TOL), (torch.float32, 1e-4)):
        for n in counts:
            x, gate_up, down, logits = _moe_layer(n, **shape, dtype=dtype, device=device, seed=n)
            ref, got = (backends[b].forward(x, gate_up, down, logits, shape["top_k"], True)
                        for b in ("torch", "triton"))
            err = float((got.double() - ref.double()).norm() / ref.double().norm())
            lines.append(f"{'ok  ' if err <= limit else 'FAIL'} moe triton vs torch, "
                         f"{str(dtype)[6:]}, {n} tokens: relative error {err:.1e} "
                         f"(limit {limit:g})")
    dtype = torch.bfloat16 if cuda else torch.float32
    lines.append(f"info moe layer time (ms), {str(dtype)[6:]}, median of {reps} warm calls "
                 f"({'CUDA events' if cuda else 'wall clock'}); weights: bytes of the experts "
                 "the tokens chose")
    lines.append(f"info   {'tokens':>6} {'experts hit':>11} {'weights MB':>10} {'torch':>9} "
                 f"{'triton':>9} {'torch/triton':>12} {'triton GB/s':>11}")
    for n in counts:
        layer = _moe_layer(n, **shape, dtype=dtype, device=device, seed=n)
        hit = int(layer[3].topk(shape["top_k"], dim=-1).indices.unique().numel())
        mb = hit * 3 * shape["hidden"] * shape["inter"] * dtype.itemsize / 1e6
        ms = {b: _median_ms(lambda b=b, layer=layer: backends[b].forward(
                  *layer, shape["top_k"], True), cuda, reps) for b in ("torch", "triton")}
        lines.append(f"info   {n:6d} {hit:11d} {mb:10.1f} {ms['torch']:9.3f} "
                     f"{ms['triton']:9.3f} {ms['torch'] / ms['triton']:11.1f}x "
                     f"{mb / ms['triton']:11.0f}")
    if cuda:
        lines += _moe_profile(backends, shape)
    lines += _moe_generate(device, model)
    return lines


def _moe_profile(backends: dict, shape: dict, tokens: int = 1) -> list[str]:
    """Where the triton layer's time goes at a few tokens: the layer replayed from a CUDA graph
    (no host work), then a profile of 20 eager calls, kernels ranked by GPU time."""
    layer = _moe_layer(tokens, **shape, dtype=torch.bfloat16, device="cuda", seed=tokens)
    run = {b: (lambda b=b: backends[b].forward(*layer, shape["top_k"], True)) for b in backends}
    lines = []
    for name, fn in run.items():
        try:
            for _ in range(3):
                fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            ms = _median_ms(graph.replay, True, 50)
            lines.append(f"info moe {name} layer at {tokens} token(s), replayed from a CUDA "
                         f"graph: {ms:.3f} ms (eager: {_median_ms(fn, True, 50):.3f} ms)")
        except Exception as exc:  # noqa: BLE001 (the torch loop reads the host: not capturable)
            lines.append(f"info moe {name} layer: no CUDA graph ({type(exc).__name__})")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                              torch.profiler.ProfilerActivity.CPU])
    with prof:
        for _ in range(20):
            run["triton"]()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / 1e3
    lines.append(f"info profile moe triton, {tokens} token(s), 20 eager calls: GPU busy "
                 f"{busy:.2f} ms, i.e. {busy / 20:.3f} ms per call")
    lines += [f"info   {e.device_time_total / 1e3:8.3f} ms {e.count:5d} calls  {e.key[:80]}"
              for e in events if e.device_type.name == "CUDA"][:10]
    return lines


def _moe_generate(device: str, model: Path | None) -> list[str]:
    """(c): the model generating 4 prompts with each backend, greedy; on the GPU in bfloat16
    with CUDA graphs for triton (torch turns them off), both against the torch backend in
    float32, the reference (a bf16 run against a bf16 run compounds two errors); on the CPU
    triton against torch in float32. Logits compared while the tokens agree. On the GPU the
    torch backend's bfloat16 error is the bar (bfloat16 alone costs that much over a few random
    layers): triton passes within 25% of it, or within BF16_TOL."""
    cuda = device == "cuda"
    if model is None:
        model = ROOT / "models" / "tiny-qwen3-moe"
    if not (model / "config.json").is_file():
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "random", "--arch",
                        "qwen3-moe", "--preset", "30b-a3b", "--out", str(model), "--device",
                        device], check=True)
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 130, 17)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    plan = [("torch", torch.float32)] + [(b, dtype) for b in ("torch", "triton")
                                         if cuda or b == "triton"]
    runs = {}
    for backend, dt in plan:
        llm = LLM(str(model), dtype=dt, device=device, moe_backend=backend,
                  num_page_override=4096, max_seq_len_override=512,
                  cuda_graph_max_bs=8 if cuda else 0)
        seen = spy_logits(llm.engine)
        start = time.perf_counter()
        out = [o["token_ids"] for o in llm.generate(prompts, params)]
        runs[backend, dt] = (out, [s.float().cpu() for s in seen], time.perf_counter() - start,
                             llm.engine.graph_runner.sizes)
        llm.shutdown()
    ref, ref_logits, t_ref, _ = runs["torch", torch.float32]
    lines = []
    baseline = None  # the torch backend's own bfloat16 error: what bfloat16 costs by itself
    for (backend, dt), (got, logits, t_got, sizes) in runs.items():
        if dt == torch.float32 and backend == "torch":
            continue
        errs = relative_errors(got, ref, logits, ref_logits)
        same = sum(a == b for a, b in zip(got, ref))
        if dt == torch.float32:
            limit, verdict = 1e-5, "ok  " if max(errs) <= 1e-5 and same == len(prompts) else "FAIL"
        elif backend == "torch":  # the reference in bfloat16: it sets the bar, it is not judged
            baseline, limit, verdict = max(errs), max(errs), "info"
        else:  # triton may round differently, not worse: within 25% of torch's bfloat16 error
            limit = BF16_TOL if baseline is None else max(BF16_TOL, 1.25 * baseline)
            verdict = "ok  " if max(errs) <= limit else "FAIL"
        lines.append(f"{verdict} moe generate {model.name}: {backend} "
                     f"{str(dt)[6:]} (graphs {sizes or 'off'}) vs torch float32: {same}/"
                     f"{len(prompts)} requests give all {params.max_tokens} tokens alike; "
                     f"relative logits error max {max(errs):.1e} over {len(errs)} steps "
                     f"(limit {limit:g}); first generate {t_got:.1f} s vs {t_ref:.1f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checks", nargs="+", choices=["stage1", "align", "bf16", "speed",
                                                      "tp1", "fi", "graph", "steps", "serve",
                                                      "kernels", "ksteps", "moe", "sampler"])
    parser.add_argument("--attn", default="fi", help="speed: our attention backend")
    parser.add_argument("--model", type=Path, help="a Qwen3-0.6B-shaped model (bf16, speed)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="speed: timed rounds per method")
    parser.add_argument("--no-cb", action="store_true", help="speed: skip HF continuous batching")
    parser.add_argument("--moe-model", type=Path, help="moe: a Qwen3-MoE model (made if missing)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: only the moe check, tiny, in Triton's interpreter")
    args = parser.parse_args()
    if args.device == "cpu":
        if args.checks != ["moe"]:
            sys.exit("--device cpu runs only the moe check")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the triton backend imports its kernel
        print(f"CPU; torch {torch.__version__}; date {datetime.date.today()}")
        lines = check_moe("cpu", args.moe_model, reps=5)
        print("\n".join(lines))
        failed = sum(line.startswith("FAIL") for line in lines)
        print(f"summary: {sum(line.startswith(('ok', 'FAIL')) for line in lines) - failed} ok, "
              f"{failed} failed")
        sys.exit(1 if failed else 0)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script is for a GPU machine")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; date {datetime.date.today()}")
    lines: list[str] = []
    for check in args.checks:
        if check == "stage1":
            lines += [line for name in MODELS for line in check_stage1(name)]
        elif check == "align":
            lines += [line for name in MODELS for line in check_align(name)]
        elif check == "bf16":
            lines += check_bf16(ROOT / "models" / "tiny-qwen3", "tiny-qwen3")
            if args.model:
                lines += check_bf16(args.model, args.model.name)
        elif check == "tp1":
            lines += check_tp1()
        elif check == "speed":
            lines += check_speed(args.model, args.requests, args.rounds, not args.no_cb,
                                 args.attn)
        elif check == "fi":
            lines += check_fi(args.model)
        elif check == "graph":
            lines += check_graph(args.model)
        elif check == "steps":
            lines += check_steps(args.model, args.rounds)
        elif check == "serve":
            lines += check_serve(args.model)
        elif check == "kernels":
            lines += check_kernels()
        elif check == "ksteps":
            lines += check_kernel_steps(args.model, args.rounds)
        elif check == "sampler":
            lines += check_sampler()
        elif check == "moe":
            lines += check_moe("cuda", args.moe_model, reps=max(20, 4 * args.rounds))
        print("\n".join(lines[-1:]), flush=True)
    print("\n".join(lines))
    failed = sum(line.startswith("FAIL") for line in lines)
    checked = sum(line.startswith(("ok", "FAIL")) for line in lines)
    print(f"summary: {checked - failed} ok, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
