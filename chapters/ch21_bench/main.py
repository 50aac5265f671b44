"""第 21 章的 main：基准测试。先数清 nano-vllm 的离线负载（256 个请求，要 133,966 个输出
token）；再看本章对采样器的修正：不截断时不再给整个词表排序，抽到的频率仍与 float64 的
softmax 一致；然后在 CPU 上用小号负载跑一遍离线基准（我们的引擎开、关重叠，和 HF 的连续批处理），
再起真的服务，用在线基准按两种到达率发请求，输出 token 数取自服务回的 usage；最后看分词进程
怎样对待一次到达的一批请求：每个请求分完词就交给调度器。

时间、速率一类的数每次运行都不同（页面上被遮住）；真正的数字在 H200 上量，见本章页面。"""

import importlib.util
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minisgl.core import SamplingParams
from minisgl.engine.sample import sample_from_probs, sample_without_cut
from minisgl.message import BatchBackendMsg, BatchFrontendMsg, TokenizeMsg
from minisgl.message.transport import IpcNamespace, ZmqPullQueue, ZmqPushQueue
from minisgl.tokenizer import tokenizer_worker

HERE = Path(__file__).resolve().parent
MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")


def load(name: str):  # noqa: ANN201 (a module)
    """One of the tree's benchmark scripts, imported from benchmark/."""
    spec = importlib.util.spec_from_file_location(name, HERE / "benchmark" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


offline, serving = load("bench_offline"), load("bench_serving")


def the_workload() -> None:
    prompts, lens = offline.workload(256, (100, 1024), (100, 1024))
    print(f"nano-vllm's workload: {len(prompts)} requests, prompts {sum(map(len, prompts)):,} "
          f"tokens ({min(map(len, prompts))}..{max(map(len, prompts))} each), outputs "
          f"{sum(lens):,} tokens asked ({min(lens)}..{max(lens)} each); nano-vllm's README "
          "says 133,966")


def the_sampler() -> None:
    """Batch 64 over Qwen3's vocabulary at temperature 0.6, no top-k or top-p."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 151936, generator=g) * 3 / 0.6, dim=-1)
    ms = {}
    for name, draw in (("sorted (chapter 6)", lambda: sample_from_probs(probs, None, None, g)),
                       ("without a sort", lambda: sample_without_cut(probs, g))):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            draw()
            times.append((time.perf_counter() - start) * 1e3)
        ms[name] = statistics.median(times)
        print(f"  draw for 64 rows of 151,936 tokens, {name}: {ms[name]:.1f} ms")
    expected = torch.softmax(torch.tensor([2.0, 1.6, 1.1, 0.9, 0.3, -0.2, -1.0, -3.0],
                                          dtype=torch.float64) / 0.8, dim=-1)
    rows = expected.float().expand(100_000, 8).contiguous()
    counts = sum(torch.bincount(sample_without_cut(rows, g), minlength=8).double()
                 for _ in range(4))
    chi2 = float(((counts - expected * 400_000) ** 2 / (expected * 400_000)).sum())
    p = float(torch.special.gammaincc(torch.tensor(3.5), torch.tensor(chi2 / 2)))
    print(f"  without a sort, 400,000 draws from 8 tokens vs the float64 softmax: chi-square "
          f"{chi2:.2f} with 7 degrees of freedom, p = {p:.3f}")


def offline_bench() -> None:
    """bench_offline.py at a small size: 8 requests; each configuration its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        subprocess.run([sys.executable, str(HERE / "benchmark" / "bench_offline.py"), "--model",
                        str(MODEL), "--requests", "8", "--input-len", "16", "64", "--output-len",
                        "8", "24", "--rounds", "1", "--group", "ours:torch:eager:on",
                        "ours:torch:eager:off", "--group", "hf", "--json", str(out)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    asked = result["workload"]["asked"]["nano"]
    print(f"offline, {result['workload']['requests']} requests, {asked} output tokens asked:")
    for row in result["rows"]:
        step = row["step_ms_p50"]
        print(f"  {row['config']:<22} {row['output_tokens']} tokens in {row['seconds']:.2f} s, "
              f"{row['tok_s']:.1f} tok/s" + ("" if step is None else
                                               f", step p50 {step:.1f} ms"))


def online_bench() -> None:
    """Our server, started for real, and bench_serving.py against it over HTTP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "minisgl", "--model", str(MODEL), "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        with open(os.devnull, "w") as quiet:
            stdout, sys.stdout = sys.stdout, quiet
            try:
                report = serving.main(["--port", str(port), "--num-prompts", "6", "--input-len",
                                       "16", "48", "--output-len", "8", "16",
                                       "--request-rates", "4", "inf", "--ready-timeout", "120"])
            finally:
                sys.stdout = stdout
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    print(f"online, {report['workload']['num_prompts']} streamed requests per rate "
          f"({report['workload']['backend']}), server stopped with exit code {code}:")
    for row in report["rows"]:
        rate = "all at once" if row["rate"] == "inf" else f"{row['rate']:g} per second"
        print(f"  {rate}: {row['completed']} done, {row['failed']} failed; TTFT "
              f"p50 {row['ttft_ms_p50']:.0f} ms, TPOT p50 {row['tpot_ms_p50']:.0f} ms, "
              f"{row['out_tok_s']:.1f} tok/s; output tokens from {row['output_len_source']}")


def a_burst(n: int = 32) -> None:
    """The tokenizer process, for real (its own process, real sockets), given n chat requests
    of about 600 words at once: when each reaches the scheduler's inbox."""
    ns, ctx = IpcNamespace(), mp.get_context("spawn")
    rng = random.Random(0)
    words = ["engine", "token", "batch", "cache", "radix", "page", "graph", "kernel", "serve"]
    chats = [[{"role": "user", "content": " ".join(rng.choices(words, k=600))}]
             for _ in range(n)]
    try:
        with ZmqPullQueue(ns.addr("backend"), bind=True, expected=BatchBackendMsg) as backend, \
                ZmqPullQueue(ns.addr("frontend"), bind=True, expected=BatchFrontendMsg) as _, \
                ZmqPushQueue(ns.addr("tokenizer"), bind=False) as api:
            ready, ready_child = ctx.Pipe()
            proc = ctx.Process(target=tokenizer_worker, kwargs=dict(
                model_path=str(MODEL), inbox=ns.addr("tokenizer"), bind_inbox=True,
                backend=ns.addr("backend"), frontend=ns.addr("frontend"), ready=ready_child))
            proc.start()
            ready.recv()
            api.put(TokenizeMsg(n, chats[0], SamplingParams(max_tokens=8), []))  # a warm-up
            assert backend.get(timeout_ms=60_000) is not None
            start = time.perf_counter()
            for uid, chat in enumerate(chats):  # one frame per request, as the API server sends
                api.put(TokenizeMsg(uid, chat, SamplingParams(max_tokens=8), []))
            arrivals, frames = [], 0
            while len(arrivals) < n:
                got = backend.get(timeout_ms=60_000)
                assert got is not None, "the tokenizer process stopped answering"
                frames += 1
                arrivals += [time.perf_counter() - start] * len(got.data)
            proc.terminate()
            proc.join(timeout=30)
    finally:
        ns.remove()
    print(f"a burst of {n} chat requests at the tokenizer process: {frames} messages to the "
          f"scheduler; requests there after {arrivals[0] * 1e3:.1f} ms (the first), "
          f"{statistics.median(arrivals) * 1e3:.1f} ms (the median), {arrivals[-1] * 1e3:.1f} ms "
          f"(the last); exit code {proc.exitcode}")


if __name__ == "__main__":
    the_workload()
    print("the sampler at temperature 0.6, no top-k or top-p:")
    the_sampler()
    offline_bench()
    online_bench()
    a_burst()
