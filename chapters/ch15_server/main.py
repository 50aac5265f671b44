"""第 15 章的 main：完整的服务。启动 `python -m minisgl`（API server、tokenizer、调度器三个进程），
等 /health 变成 200；用官方 openai 客户端（严格校验响应）各发一次非流式和流式请求，再让 8 个客户端
同时提问，每个贪心输出都与同一组 token id 上的 LLM.generate 相同；最后发 SIGTERM，查进程和 ipc
文件都已不在。"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch
from transformers import AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.llm import LLM

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
             "Say hello in Spanish.", "What colour is the sky?", "Name a fruit.",
             "How many legs does a cat have?", "What is the opposite of hot?"]
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float = 300) -> dict:
    """Once /health says 200: the processes, name -> pid (a debug route: --enable-debug)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                pass
            with urllib.request.urlopen(f"{base}/debug/processes", timeout=5) as r:
                return json.load(r)
        except OSError:  # refused, or 503 while the processes start
            time.sleep(0.5)
    raise SystemExit(f"the server did not become healthy (exit code {server.poll()})")


def raw_stream(base: str, chat: list[dict[str, str]], max_tokens: int) -> list[str]:
    """The lines of one streamed chat completion as they come over the wire, but for the
    fields every event repeats (id, object, created, model), shown once as `…`."""
    body = {"model": "any", "messages": chat, "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        text = r.read().decode()
    text = re.sub(r'"id": "chatcmpl-[0-9a-f]{32}", "object": "chat.completion.chunk", '
                  r'"created": \d+, "model": "[^"]*"', "…", text)
    return text.split("\n")[:-1]  # the last event's blank line ends the text


def main() -> None:
    port, tmp = free_port(), tempfile.mkdtemp(prefix="ch15-")
    env = dict(os.environ, TMPDIR=tmp)  # the server's ipc folder goes there: easy to check
    server = subprocess.Popen([sys.executable, "-m", "minisgl", "--model", str(MODEL),
                               "--port", str(port), "--enable-debug"], env=env,
                              stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    processes = wait_healthy(base, server)
    print(f"/health 200; /debug/processes: {sorted(processes)}")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none",
                           _strict_response_validation=True)
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    whole = client.chat.completions.create(model="any", messages=chat, temperature=0,
                                           max_tokens=MAX_TOKENS)
    print(f"non-streaming: {whole.choices[0].message.content!r}")
    print(f"    finish_reason {whole.choices[0].finish_reason!r}, usage {whole.usage.prompt_tokens}"
          f" + {whole.usage.completion_tokens} tokens, object {whole.object!r}")
    chunks = list(client.chat.completions.create(
        model="any", messages=chat, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    print(f"streaming: {len(chunks)} chunks, role {chunks[0].choices[0].delta.role!r} first, "
          f"usage chunk last {chunks[-1].usage.total_tokens} tokens; same text: "
          f"{text == whole.choices[0].message.content}")
    print("the same chat streamed, max_tokens 2, line by line as sent (… for id, object, "
          "created, model):")
    for line in raw_stream(base, chat, max_tokens=2):
        print(f"  | {line}".rstrip())

    def ask(question: str) -> tuple[str, str]:
        reply = client.chat.completions.create(model="any", temperature=0, max_tokens=MAX_TOKENS,
                                               messages=[{"role": "user", "content": question}])
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # eight clients at once
        answers = list(pool.map(ask, QUESTIONS))

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False)
           for q in QUESTIONS]
    llm = LLM(str(MODEL), dtype=torch.float32)
    offline = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
    same = 0
    for q, (answer, reason), out in zip(QUESTIONS, answers, offline):
        equal = answer == tokenizer.decode(out["token_ids"], skip_special_tokens=True)
        same += equal
        print(f"  {q:<34} {reason:<6} {'==' if equal else '!='} LLM.generate  {answer[:40]!r}")
    print(f"8 concurrent clients: {same}/8 equal to LLM.generate on the same token ids")

    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=30)
    alive = []
    for pid in processes.values():
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    print(f"SIGTERM: exit code {code}, processes left {len(alive)}, ipc files left "
          f"{sum(1 for _ in Path(tmp).rglob('*'))}")
    llm.shutdown()


if __name__ == "__main__":
    main()
