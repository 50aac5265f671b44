"""第 16 章的 main：张量并行，在 CPU 上用真实的进程和 gloo 跑。SmolLM2 有 9 个 q 头、3 个 KV 头：
tp=2 在启动时被拒绝（消息里给出能整除的 tp）；tp=3 时离线 LLM 在 3 个进程里各持三分之一的权重，
贪心 token 与 tp=1 逐个相同；最后 `python -m minisgl --tp 3` 起 5 个进程（API、tokenizer、3 个
调度器 rank），流式对话的文字与离线结果相同，SIGTERM 后一个进程也不剩。"""

import json
import multiprocessing as mp
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai
import psutil
import torch
from transformers import AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.distributed.shard import local_config
from minisgl.llm import LLM
from minisgl.models import ModelConfig, load_hf_config

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
QUESTION = "What is the capital of France?"
MAX_TOKENS = 16
TP = 3


def generate(rank: int, size: int, rendezvous: str, prompt: list[int]) -> dict:
    """One rank's run: its greedy tokens, the bytes of weights it holds, and how far its
    resident memory rose while the LLM (weights first) was built."""
    before = psutil.Process().memory_info().rss
    llm = LLM(str(MODEL), dtype=torch.float32, num_page_override=256,  # a small KV pool
              tp_info=DistributedInfo(rank, size), dist_init=rendezvous)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    held = sum(t.nbytes for t in llm.engine.model.state_dict().values())
    try:
        tokens = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0]["token_ids"]
    finally:
        llm.shutdown()
    return dict(rank=rank, tokens=tokens, held=held, peak=peak)


def _rank(rank: int, size: int, rendezvous: str, prompt: list[int], out: mp.Queue) -> None:
    out.put(generate(rank, size, rendezvous, prompt))


def offline_tp(size: int, prompt: list[int]) -> list[dict]:
    """`size` rank processes, each running the same LLM script on its rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = f"file://{tempfile.mkdtemp(prefix='ch16-')}/rendezvous"
    procs = [ctx.Process(target=_rank, args=(r, size, rendezvous, prompt, out))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        return sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def serve_tp(size: int, chat: list[dict], expected: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "minisgl", "--model", str(MODEL),
                               "--port", str(port), "--tp", str(size), "--enable-debug"],
                              stderr=subprocess.DEVNULL)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                pass
            with urllib.request.urlopen(f"{base}/debug/processes", timeout=5) as r:
                processes = json.load(r)  # name -> pid (a debug route: --enable-debug)
                break
        except OSError:  # refused, or 503 while the ranks start
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"no server (exit code {server.poll()})") from None
            time.sleep(0.5)
    print(f"--tp {size}: {len(processes)} processes {sorted(processes)}")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    chunks = client.chat.completions.create(model="any", messages=chat, temperature=0,
                                            max_tokens=MAX_TOKENS, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    print(f"streamed over HTTP: {text!r}; same as offline: {text == expected}")
    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=30)
    left = [p for p in processes.values() if psutil.pid_exists(p)]
    print(f"SIGTERM: exit code {code}, processes left {len(left)}")


def main() -> None:
    config = ModelConfig.from_hf(load_hf_config(str(MODEL)))
    print(f"{MODEL.name}: {config.num_qo_heads} q heads, {config.num_kv_heads} KV heads, "
          f"intermediate {config.intermediate_size}, vocabulary {config.vocab_size}")
    try:
        local_config(config, DistributedInfo(0, 2))
    except ValueError as e:
        print(f"tp=2 refused: {e}")

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    chat = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                           return_dict=False)
    [one] = offline_tp(1, prompt)
    ranks = offline_tp(TP, prompt)
    print(f"tp=1: {tokenizer.decode(one['tokens'])!r}")
    print(f"tp={TP}: every rank gives the same {len(one['tokens'])} tokens as tp=1: "
          f"{all(r['tokens'] == one['tokens'] for r in ranks)}")
    mib = 2**20
    print(f"weights held: tp=1 {one['held'] / mib:.0f} MiB, "
          f"peak RSS rise {one['peak'] / mib:.0f} MiB")
    for r in ranks:
        print(f"  rank {r['rank']} of {TP}: {r['held'] / mib:.0f} MiB "
              f"({r['held'] / one['held']:.2f} of tp=1), peak RSS rise {r['peak'] / mib:.0f} MiB")
    serve_tp(TP, chat, tokenizer.decode(one["tokens"], skip_special_tokens=True))


if __name__ == "__main__":
    main()
