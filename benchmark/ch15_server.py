"""第 15 章的基准：服务的延迟，和服务路径比离线 LLM.generate 多花的时间。
CPU 上的 SmolLM2-135M-Instruct，float32。

    python benchmark/ch15_server.py            # 延迟（1 个、8 个并发客户端）+ 吞吐，10 轮
    python benchmark/ch15_server.py --quick    # 冒烟测试：各 1 轮、4 个 token

延迟：对话请求，流式，贪心，忽略 EOS，各 64 个 token。TTFT 是发出请求到收到第一段文字；
ITL 是相邻两段文字之间的间隔（一段通常是一个 token；不完整的 UTF-8 字符会等下一个 token）。
吞吐：同样的 32 组 token id（对话模板套好的提示词），各 64 个 token，离线是一次 LLM.generate，
服务是 32 个同时发出的 /v1/completions 请求，直到全部回来。两边轮流计时，取中位数；
服务进程和本进程的 LLM 不同时计算。
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "examples")]

import torch  # noqa: E402
from ch11_speed import cpu_model  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "a city", "trees", "music", "the moon", "bread", "rain", "a library"]


def start_server(port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.Popen([sys.executable, "-m", "minisgl", "--model", str(MODEL), "--port",
                             str(port)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def post(port: int, path: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})


def stream_times(port: int, question: str, max_tokens: int) -> tuple[float, list[float]]:
    """TTFT and the gaps between chunks of text of one streamed chat request."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(post(port, "/v1/chat/completions", body)) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def latency(port: int, clients: int, rounds: int, max_tokens: int) -> str:
    ttft: list[float] = []
    itl: list[float] = []
    questions = [f"Write a few sentences about {t}." for t in TOPICS]
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(rounds):
            first, gaps = stream_times(port, questions[(i + r) % len(questions)], max_tokens)
            with lock:
                ttft.append(first)
                itl.extend(gaps)

    stream_times(port, questions[0], 4)  # warm-up
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return (f"  {clients} client(s), {len(ttft)} requests: TTFT p50 {pct(ttft, .5) * 1e3:.0f} ms, "
            f"p99 {pct(ttft, .99) * 1e3:.0f} ms; ITL p50 {pct(itl, .5) * 1e3:.1f} ms, "
            f"p99 {pct(itl, .99) * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description="the server's latency and overhead")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 round of 4 tokens")
    args = parser.parse_args()
    rounds, max_tokens = (1, 4) if args.quick else (args.rounds, 64)
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(port)
    try:
        print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; torch {torch.__version__}; "
              f"{MODEL.name}, float32, greedy, ignore_eos, {max_tokens} new tokens per request")
        print("latency, streamed chat requests:")
        print(latency(port, 1, rounds, max_tokens))
        print(latency(port, 8, max(1, rounds // 2), max_tokens))

        tokenizer = AutoTokenizer.from_pretrained(MODEL)
        prompts = [tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about {t}, part {i}."}], tokenize=True,
            add_generation_prompt=True, return_dict=False) for i in range(4) for t in TOPICS]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        llm = LLM(str(MODEL), dtype=torch.float32)
        body = lambda p: {"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": True}

        def served() -> list[str]:
            with ThreadPoolExecutor(len(prompts)) as pool:
                replies = pool.map(lambda p: json.load(urllib.request.urlopen(
                    post(port, "/v1/completions", body(p))))["choices"][0]["text"], prompts)
                return list(replies)

        def offline() -> list[str]:
            outs = llm.generate(prompts, params)
            return [tokenizer.decode(o["token_ids"], skip_special_tokens=True) for o in outs]

        solo = []  # the same one request offline: what the server's ITL at 1 client adds to
        for _ in range(rounds):
            start = time.perf_counter()
            llm.generate([prompts[0]], params)
            solo.append((time.perf_counter() - start) / max_tokens)
        per_token = statistics.median(solo) * 1e3
        print(f"  offline, the same engine in-process, 1 request: {per_token:.1f} ms per output "
              f"token (prefill included), median of {rounds}")
        times: dict[str, list[float]] = {"offline": [], "server": []}
        texts: dict[str, list[str]] = {}
        for i in tqdm(range(rounds + 1), desc="throughput rounds", file=sys.stderr):
            for name, run in (("offline", offline), ("server", served)):
                start = time.perf_counter()
                texts[name] = run()
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        n = len(prompts) * max_tokens
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"throughput, {len(prompts)} requests of {min(map(len, prompts))}-"
              f"{max(map(len, prompts))} prompt tokens, median of {rounds} rounds in turns:")
        for name, t in med.items():
            print(f"  {name:<8} {t:6.2f} s (min {min(times[name]):.2f} s, max "
                  f"{max(times[name]):.2f} s), {n / t:.1f} tok/s")
        print(f"  server overhead: {(med['server'] / med['offline'] - 1) * 100:+.1f}% of the "
              f"offline time; same text for {sum(a == b for a, b in zip(*texts.values()))} of "
              f"{len(prompts)} requests")
        llm.shutdown()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
