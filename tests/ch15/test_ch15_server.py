"""Chapter 15: the server, for real: `python -m minisgl` in a subprocess, HTTP over loopback,
the official openai client with strict response validation, bad input, 64 concurrent streams,
clients that go away, a killed scheduler, SIGTERM, the shell."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import torch
from transformers import AutoTokenizer

from minisgl.server.args import parse_args

from helpers import assert_cleaned_up_after_kill, chat_answer, questions
from reference import hf_greedy
from serving import MAX_SEQ_LEN, Server, gone

CHAT = [{"role": "user", "content": "Count: one two three"}]


def sse_events(raw: bytes) -> list[str]:
    """The data of each server-sent event; every event must end with a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def greedy(server: Server, **kw: Any) -> Any:
    return server.client().chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=10,
        extra_body={"ignore_eos": True}, **kw)


# --- the contract --------------------------------------------------------------------------------

def test_health_models_and_a_loopback_bind(server: Server, model: Path) -> None:
    assert sorted(server.processes) == ["launcher", "scheduler", "tokenizer"]
    [m] = server.client().models.list().data
    assert m.id == model.name and m.object == "model"
    listening = [c for c in psutil.Process(server.proc.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"]  # no --host: this machine only


def test_chat_whole_and_streamed(server: Server, model: Path) -> None:
    whole = greedy(server)
    [choice] = whole.choices
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    prompt = AutoTokenizer.from_pretrained(model).apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == len(prompt) + 10

    chunks = list(greedy(server, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and reasons.count("length") == 1 and set(reasons) == {
        None, "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content


def test_finish_reason_is_length_exactly_at_max_tokens(server: Server) -> None:
    full = greedy(server).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = greedy(server, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]
    room = server.client().completions.create(  # no max_tokens: as many as the context holds
        model="tiny", prompt=[5, 6, 7], temperature=0, extra_body={"ignore_eos": True})
    assert room.choices[0].finish_reason == "length"
    assert room.usage.prompt_tokens + room.usage.completion_tokens == MAX_SEQ_LEN


def test_completions_and_generate_over_raw_http(server: Server, model: Path) -> None:
    body = {"prompt": [5, 80, 200, 31], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, raw = server.request("POST", "/v1/completions", body)
    whole = json.loads(raw)
    assert status == 200 and whole["object"] == "text_completion"
    hf = AutoTokenizer.from_pretrained(model).decode(hf_greedy(model, body["prompt"], 8)[0],
                                                     skip_special_tokens=True)
    assert whole["choices"][0]["text"] == hf  # HF's greedy tokens, through the whole server
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["total_tokens"] == 12
    status, raw = server.request("POST", "/v1/completions", {**body, "stream": True})
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all({"id", "object", "created", "model"} <= c.keys() for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]

    status, raw = server.request("POST", "/generate", body)  # greedy unless asked
    assert status == 200 and json.loads(raw)["text"] == whole["choices"][0]["text"]
    status, raw = server.request("POST", "/generate", {**body, "stream": True})
    events = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert "".join(e["text"] for e in events) == whole["choices"][0]["text"]
    assert events[-1]["finish_reason"] == "length" and events[-1]["usage"] == whole["usage"]


# --- bad input -----------------------------------------------------------------------------------

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
BAD = [  # (what, path, body, expected status, param named in the error)
    ("not JSON", CHAT_URL, b'{"messages": [', 400, None),
    ("no messages", CHAT_URL, {"max_tokens": 4}, 400, "messages"),
    ("messages not a list", CHAT_URL, {"messages": "hi"}, 400, "messages"),
    ("a role we do not know", CHAT_URL, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("max_tokens as a string", CHAT_URL, {"messages": CHAT, "max_tokens": "5"}, 400,
     "max_tokens"),
    ("negative max_tokens", CHAT_URL, {"messages": CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("temperature < 0", CHAT_URL, {"messages": CHAT, "temperature": -0.1}, 400, "temperature"),
    ("top_p = 0", CHAT_URL, {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", CHAT_URL, {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("n = 2", CHAT_URL, {"messages": CHAT, "n": 2}, 400, "n"),
    ("a chat longer than the context", CHAT_URL,
     {"messages": [{"role": "user", "content": "a b " * MAX_SEQ_LEN}]}, 400, None),
    ("a prompt of max_seq_len ids", COMPLETIONS_URL, {"prompt": [5] * MAX_SEQ_LEN}, 400, None),
    ("a token id out of range", COMPLETIONS_URL, {"prompt": [5, 10**6]}, 400, None),
    ("an empty prompt", COMPLETIONS_URL, {"prompt": ""}, 400, "prompt"),
    ("no such endpoint", "/v1/embeddings", {"input": "x"}, 404, None),
]


def test_bad_input_gets_openai_errors_and_the_server_goes_on(server: Server) -> None:
    before = greedy(server).choices[0].message.content
    for what, path, body, status, param in BAD:
        start = time.monotonic()
        got, raw = server.request("POST", path, body, timeout=10)
        error = json.loads(raw)["error"]
        assert got == status, (what, raw)
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
        assert error["param"] == param, (what, error)
        assert time.monotonic() - start < 5, what  # answered at once, never left hanging
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().chat.completions.create(model="tiny", messages=CHAT, temperature=-1)
    assert greedy(server).choices[0].message.content == before


def test_a_stream_that_cannot_run_is_a_400_before_any_event(server: Server) -> None:
    """A prompt only the tokenizer can find too long: its error is the first reply, and the
    status line waits for it, so a client that asked for a stream gets OpenAI's 400, not a 200
    whose stream breaks."""
    text = "hello " * MAX_SEQ_LEN
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                       ("/v1/completions", {"prompt": text}), ("/generate", {"prompt": text})]:
        status, raw = server.request("POST", path, {"model": "tiny", "max_tokens": 4,
                                                    "stream": True, **body})
        assert status == 400, (path, raw)
        message = json.loads(raw)["error"]["message"]
        assert "tokens" in message and str(MAX_SEQ_LEN) in message, (path, raw)
    assert greedy(server).choices[0].finish_reason == "length"  # and it goes on serving


# --- load and clients that go away ---------------------------------------------------------------

def test_64_concurrent_streams_each_equal_its_solo_output(server: Server) -> None:
    chats, client = questions(16), server.client()
    solo = [chat_answer(client, c, False, 12) for c in chats]
    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(lambda i: chat_answer(client, chats[i % 16], True, 12),
                                 range(64)))
    assert together == [solo[i % 16] for i in range(64)]


def _drop_mid_stream(server: Server) -> None:
    """A client that reads two events of a long stream and closes its socket."""
    body = json.dumps({"prompt": [9, 8, 7], "max_tokens": 400, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while seen.count(b"data: ") < 2:
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream first"
            seen += chunk


def _drop_before_the_answer(server: Server) -> None:
    body = json.dumps({"prompt": [9, 8, 7], "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)  # running by now; 400 tokens take far longer


def test_clients_that_go_away_give_back_every_row_and_page(server: Server) -> None:
    before = server.stats()["aborted"]
    with ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda i: (_drop_mid_stream if i < 16 else _drop_before_the_answer)(
            server), range(20)))
    deadline = time.monotonic() + 30
    while not (stats := server.stats())["idle"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["aborted"] - before == 20  # each was stopped, none ran to its 400 tokens
    # the scheduler's own check: every table row free, every page free or in the prefix cache
    assert stats["idle"] and stats["integrity"] == "ok", stats
    assert stats["free_rows"] == stats["total_rows"]
    assert greedy(server).choices[0].finish_reason == "length"  # and it still serves


# --- processes: start, workers, SIGTERM, a dead scheduler, the shell -----------------------------

def test_workers_then_sigterm_leaves_nothing(model: Path, tmp_path: Path,
                                             server: Server) -> None:
    expected = greedy(server).choices[0].message.content
    s = Server(model, tmp_path, "--num-tokenizer", "2", "--shutdown-timeout", "1", held_s=2)
    got: list[tuple[int, bytes]] = []
    try:
        seen = s.wait_ready()
        assert seen[0] == 503 and seen[-1] == 200  # answering, but "starting", at first (held)
        assert sorted(s.processes) == ["detokenizer", "launcher", "scheduler", "tokenizer-0",
                                       "tokenizer-1"]
        assert greedy(s).choices[0].message.content == expected
        stream = threading.Thread(target=lambda: got.append(s.request(
            "POST", COMPLETIONS_URL, {"prompt": [1, 2], "max_tokens": 500, "stream": True,
                                      "ignore_eos": True})))
        stream.start()  # a request in flight when the signal comes
        time.sleep(0.5)
        start = time.monotonic()
        assert s.stop() == 0
        assert gone(s.pids(), 10 - (time.monotonic() - start))
        stream.join(timeout=10)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    # not cut silently: finished within the drain's 1 s, or ended by an error event; [DONE]
    [(status, raw)] = got
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert ("shutting down" in last["error"]["message"] if "error" in last
            else last["choices"][0]["finish_reason"] == "length")
    assert not [p for p in tmp_path.iterdir() if p.name != "server.log"]  # no ipc folder left


def test_a_dead_scheduler_stops_the_server_with_an_error(model: Path, tmp_path: Path) -> None:
    s = Server(model, tmp_path)
    try:
        s.wait_ready()
        os.kill(s.processes["scheduler"], signal.SIGKILL)
        try:  # until the launcher notices: 503, or a closed port once it has stopped
            status, _ = s.request("GET", "/health", timeout=5)
            assert status in (200, 503)
        except OSError:
            pass
        assert s.proc.wait(timeout=15) == 1
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert_cleaned_up_after_kill(s, "scheduler", tmp_path, 5)


def test_shell_chats_with_history_reset_and_exit(model: Path, tmp_path: Path) -> None:
    package_root = Path(importlib.util.find_spec("minisgl").origin).parent.parent
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [str(package_root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(model), "--shell",
         "--max-seq-len-override", "64"], input="hello\nhello\n/reset\nhello\n/exit\n",
        capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ready, rest = out.stdout.split("\n", 1)
    assert "is ready" in ready
    before, after = rest.split("(conversation reset)\n")  # answers may hold newlines
    # the tiny model never says EOS: its first answer fills the 64-token context, so the second
    # turn (question, answer, question) cannot fit; the shell says so and goes on
    assert "error: the prompt has" in out.stderr
    # after /reset the same question with no history: the same greedy answer
    assert before == after and len(after) > 1


@pytest.mark.parametrize("arch,flags", [("tiny-llama", ["--cache-type", "naive"]),
                                        ("tiny-qwen2", []), ("tiny-mistral", [])])
def test_every_architecture_serves_hf_greedy_tokens(arch: str, flags: list[str], tmp_path: Path,
                                                    model_dir: Callable[[str], Path]) -> None:
    """The whole server against HF for the architectures the tiny-qwen3 server above does not
    cover: token ids in, greedy tokens out, equal to HF generate's."""
    path = model_dir(arch)
    prompt = [7, 300, 41, 99, 5, 260, 18]
    s = Server(path, tmp_path, *flags)
    try:
        s.wait_ready()
        status, raw = s.request("POST", "/generate", {"prompt": prompt, "max_tokens": 8,
                                                      "ignore_eos": True})
    finally:
        s.stop()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert status == 200
    assert json.loads(raw)["text"] == tokenizer.decode(hf_greedy(path, prompt, 8)[0],
                                                       skip_special_tokens=True)


def test_a_killed_launcher_takes_every_child_with_it(model_dir: Callable[[str], Path],
                                                     tmp_path: Path) -> None:
    """kill -9 of the launcher runs none of its clean-up: the kernel stops the children (their
    parent-death signal), so no process of the server outlives it."""
    s = Server(model_dir("tiny-qwen3"), tmp_path)
    try:
        s.wait_ready()
        descendants = [p.pid for p in psutil.Process(s.proc.pid).children(recursive=True)]
        assert len(descendants) >= 2  # the scheduler and the tokenizer at least
        s.proc.kill()
        s.proc.wait(timeout=30)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert gone(descendants, 10)


def test_the_launcher_counts_gpus_without_initialising_cuda(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher forks its children, and a child cannot use CUDA that its parent has
    initialised: reading the flags must not call torch.cuda.is_available(), which does."""
    def initialises_cuda() -> bool:
        raise AssertionError("torch.cuda.is_available() initialises CUDA before the fork")

    monkeypatch.setattr(torch.cuda, "is_available", initialises_cuda)
    assert parse_args(["--model", str(model)]).scheduler.model_path == str(model)
