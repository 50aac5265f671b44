"""Chapter 16: `python -m minisgl --tp 2` on the CPU: two scheduler ranks over gloo behind one
API server, answering as one rank does; a rank's death and SIGTERM leave nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from helpers import assert_cleaned_up_after_kill, chat_answer, questions
from reference import hf_greedy
from serving import STOP_S, Server, gone

PROMPT = [7, 300, 41, 99, 5, 260, 18]


@pytest.fixture(scope="module")
def model(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("tiny-llama-kv1")  # one KV head: both ranks hold a copy


@pytest.fixture(scope="module")
def tp2(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(model, tmp_path_factory.mktemp("tp2"), "--tp", "2")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _generate(server: Server, prompt: list[int], n: int) -> str:
    status, raw = server.request("POST", "/generate", {"prompt": prompt, "max_tokens": n,
                                                       "ignore_eos": True})
    assert status == 200, raw
    return json.loads(raw)["text"]


def test_four_processes_and_hf_greedy_tokens(tp2: Server, model: Path) -> None:
    assert sorted(tp2.processes) == ["launcher", "scheduler-0", "scheduler-1",
                                               "tokenizer"]
    expected = AutoTokenizer.from_pretrained(model).decode(hf_greedy(model, PROMPT, 8)[0],
                                                           skip_special_tokens=True)
    assert _generate(tp2, PROMPT, 8) == expected


def test_a_streamed_chat_and_concurrent_clients(tp2: Server) -> None:
    chats, client = questions(8), tp2.client()
    solo = [chat_answer(client, c, False, 10) for c in chats]  # one request at a time
    with ThreadPoolExecutor(16) as pool:  # then together: the ranks must batch them alike
        together = list(pool.map(lambda i: chat_answer(client, chats[i % 8], True, 10),
                                 range(16)))
    differ = [i for i in range(16) if together[i] != solo[i % 8]]
    assert not differ, "concurrent streams differ from their solo answers"  # which: timing
    status, raw = tp2.request("POST", "/v1/completions", {"prompt": [5, 10**6]})
    assert status == 400 and "token ids" in json.loads(raw)["error"]["message"]
    stats = tp2.stats()  # rank 0's view; the other rank's loop ran the same steps
    assert stats["idle"] and stats["integrity"] == "ok", stats


def test_sigterm_stops_every_rank(tp2: Server) -> None:
    start = time.monotonic()
    assert tp2.stop() == 0
    assert gone(tp2.pids(), STOP_S - (time.monotonic() - start))
    assert not [p for p in tp2.tmp.iterdir() if p.name != "server.log"]  # no ipc folder


def test_a_dead_rank_stops_the_server_with_exit_1(model: Path, tmp_path: Path) -> None:
    s = Server(model, tmp_path, "--tp", "2")
    try:
        s.wait_ready()
        os.kill(s.processes["scheduler-1"], signal.SIGKILL)
        assert s.proc.wait(timeout=20) == 1  # rank 0 would wait in a collective: not for long
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert_cleaned_up_after_kill(s, "scheduler-1", tmp_path, 10)


def test_heads_that_do_not_divide_are_refused_before_any_process(
        model_dir: Callable[[str], Path]) -> None:
    out = subprocess.run([sys.executable, "-m", "minisgl", "--model",
                          str(model_dir("SmolLM2-135M-Instruct")), "--tp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--tp-size 2: num_attention_heads = 9 does not divide by tp = 2" in out.stderr
    assert "divisors: [1, 3, 9]" in out.stderr


@pytest.mark.parametrize("arch,flags", [("tiny-qwen3", []),
                                        ("tiny-llama", ["--cache-type", "naive"]),
                                        ("tiny-qwen2", []), ("tiny-mistral", [])])
def test_every_architecture_at_tp2_serves_hf_greedy_tokens(arch: str, flags: list[str],
                                                           tmp_path: Path,
                                                           model_dir: Callable[[str], Path]
                                                           ) -> None:
    """The four architectures of the offline TP test, through the whole --tp 2 server."""
    path = model_dir(arch)
    s = Server(path, tmp_path, "--tp", "2", *flags)
    try:
        s.wait_ready()
        text = _generate(s, PROMPT, 8)
    finally:
        s.stop()
    expected = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, PROMPT, 8)[0],
                                                          skip_special_tokens=True)
    assert text == expected


def test_the_shell_at_tp2(model: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(model), "--tp", "2", "--shell",
         "--max-seq-len-override", "64"], input="hello\n/exit\n", capture_output=True,
        text=True, timeout=120, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    ready, answer = out.stdout.split("\n", 1)
    assert "is ready" in ready and len(answer.strip()) > 0
    assert not list(tmp_path.iterdir())  # no ipc folder left


@pytest.mark.parametrize("victim", ["scheduler-0", "scheduler-2"])
def test_kill_9_of_a_rank_under_load_at_tp_3(victim: str, model_dir: Callable[[str], Path],
                                             tmp_path: Path) -> None:
    """SmolLM2 (9 query and 3 KV heads) splits three ways. With 8 streams running, one rank is
    killed: the server exits 1, every stream ends with an error (an error event and [DONE], or a
    503 if no token came yet, or the closed connection once the launcher is gone), and no
    process or ipc file is left."""
    s = Server(model_dir("SmolLM2-135M-Instruct"), tmp_path, "--tp", "3")
    results: list[tuple[int, bytes]] = []

    def stream() -> None:
        try:
            results.append(s.request("POST", "/v1/completions", {
                "prompt": [7, 8, 9], "max_tokens": 300, "stream": True, "ignore_eos": True},
                timeout=60))
        except OSError:
            results.append((0, b""))

    try:
        s.wait_ready(timeout_s=300)
        with ThreadPoolExecutor(8) as pool:
            for _ in range(8):
                pool.submit(stream)
            time.sleep(1.0)
            os.kill(s.processes[victim], signal.SIGKILL)
            assert s.proc.wait(timeout=30) == 1
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert f"the {victim} process" in s.log.read_text()
    assert gone(s.pids(), 10)
    assert not [p for p in tmp_path.iterdir() if p.name != "server.log"]
    assert len(results) == 8
    for status, raw in results:
        if status == 503:
            assert f"the {victim} process" in json.loads(raw)["error"]["message"]
        elif status:
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
            assert b'"error"' in raw.rsplit(b"data: ", 2)[1] or b"finish_reason" in raw
