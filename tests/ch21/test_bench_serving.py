"""Chapter 21: benchmark/bench_serving.py, the serving benchmark. Its arithmetic against a fake
server that streams at known times, then a short run against our real server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from benchmarks import load

from serving import Server, gone

bench = load("bench_serving")

# (seconds after the previous event, the event's data): a first text chunk at 0.2 s, then three
# more every 0.1 s; on the way a role-only or empty-text chunk that is not text.
TEXT = {"completions": lambda t: {"choices": [{"index": 0, "text": t, "finish_reason": None}]},
        "chat": lambda t: {"choices": [{"index": 0, "delta": {"content": t},
                                        "finish_reason": None}]}}
NOT_TEXT = {"completions": {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
            "chat": {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None}]}}
USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                  "total_tokens": 7}}


def script(backend: str, with_usage: bool) -> list[tuple[float, Any]]:
    text, finish = TEXT[backend], {"index": 0, "text": "", "delta": {}, "finish_reason": "length"}
    events = [(0.05, NOT_TEXT[backend]), (0.15, text("a")), (0.05, NOT_TEXT[backend]),
              (0.05, text("b")), (0.1, text("c")), (0.1, text("d")), (0.0, {"choices": [finish]})]
    return events + ([(0.0, USAGE)] if with_usage else []) + [(0.0, "[DONE]")]


class FakeServer:
    """An SSE server in a thread that answers every POST with `events`, and keeps the bodies."""

    def __init__(self, events: list[tuple[float, Any]]) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                fake.posts.append((self.path, json.loads(self.rfile.read(length))))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for delay, data in events:
                    time.sleep(delay)
                    text = data if isinstance(data, str) else json.dumps(data)
                    self.wfile.write(f"data: {text}\n\n".encode())
                    self.wfile.flush()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake() -> Iterator[Callable[[list[tuple[float, Any]]], FakeServer]]:
    made: list[FakeServer] = []

    def make(events: list[tuple[float, Any]]) -> FakeServer:
        made.append(FakeServer(events))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.mark.parametrize("backend", ["completions", "chat"])
def test_metrics_against_a_fake_server_with_usage(backend: str, fake: Callable) -> None:
    server = fake(script(backend, with_usage=True))
    r = bench.one_request(bench.Target(port=server.port, backend=backend, timeout=10),
                          [5, 6, 7] if backend == "completions" else "hi", 9)
    assert r.ok and r.error == ""
    # Bounds the script makes certain whatever the machine's load: no text before 0.2 s (the
    # role-only / empty chunk at 0.05 s is not text), [DONE] not before 0.5 s; the upper bounds
    # only catch a clock that never stopped.
    assert 0.2 <= r.ttft < 5
    assert len(r.itl) == 3 and all(0 <= x < 5 for x in r.itl)  # between the 4 text chunks
    assert 0.5 <= r.e2e < 10 and r.e2e >= r.ttft + sum(r.itl) - 1e-9
    assert r.from_usage and r.output_tokens == 4  # usage's count, not the 9 asked for
    row = bench.summarize(float("inf"), [r], 2.0)
    assert row["output_len_source"] == "usage" and row["completed"] == 1 and row["failed"] == 0
    assert row["tpot_ms_p50"] == pytest.approx(1e3 * (r.e2e - r.ttft) / 3)
    assert row["ttft_ms_p99"] == pytest.approx(1e3 * r.ttft)
    assert row["itl_ms_p50"] == pytest.approx(1e3 * sorted(r.itl)[1])
    assert row["req_s"] == 0.5 and row["out_tok_s"] == 2.0 and row["rate"] == "inf"
    [(path, body)] = server.posts
    assert path == bench.ENDPOINTS[backend]
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 9
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    if backend == "chat":
        assert body["messages"] == [{"role": "user", "content": "hi"}]
    else:
        assert body["prompt"] == [5, 6, 7]


@pytest.mark.parametrize("backend", ["completions", "chat"])
def test_no_usage_falls_back_to_the_requested_length(backend: str, fake: Callable) -> None:
    server = fake(script(backend, with_usage=False))
    r = bench.one_request(bench.Target(port=server.port, backend=backend, timeout=10), "x", 9)
    assert r.ok and not r.from_usage and r.output_tokens == 9 and len(r.itl) == 3
    row = bench.summarize(2.0, [r, bench.Result(error="HTTP 500: b''")], 1.0)
    assert row["output_len_source"] == "requested" and row["out_tok_s"] == 9.0
    assert row["completed"] == 1 and row["failed"] == 1 and row["first_error"] == "HTTP 500: b''"
    assert row["tpot_ms_p50"] == pytest.approx(1e3 * (r.e2e - r.ttft) / 8)
    text = "\n".join(bench.table([row]))
    assert "as requested: the server sent no usage; valid only with ignore_eos" in text
    assert "1 failed; first error: HTTP 500" in text


def test_a_stream_without_done_or_text_fails(fake: Callable) -> None:
    target = bench.Target(port=fake([(0.0, TEXT["completions"]("a"))]).port, timeout=10)
    assert bench.one_request(target, [1], 2).error == "the stream ended without [DONE]"
    target = bench.Target(port=fake([(0.0, USAGE), (0.0, "[DONE]")]).port, timeout=10)
    assert bench.one_request(target, [1], 2).error == "no chunk with text"


def test_against_our_server(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model = model_dir("tiny-qwen3")  # vocabulary 512: prompt ids below 500
    s = Server(model, tmp_path)
    try:
        s.wait_ready()
        out = tmp_path / "serving.json"
        report = bench.main(["--port", str(s.port), "--num-prompts", "5", "--input-len", "8",
                             "32", "--output-len", "4", "8", "--vocab", "500", "--request-rates",
                             "inf", "20", "--max-concurrency", "2", "--json", str(out),
                             "--machine", "test", "--label", "ours"])
        assert json.loads(out.read_text()) == report
        assert set(report) == {"bench", "machine", "date", "versions", "command", "server",
                               "workload", "rows"}
        assert report["machine"] == "test" and report["server"] == "ours"
        assert report["workload"] == {"num_prompts": 5, "input_len": [8, 32],
                                      "output_len": [4, 8], "vocab": 500, "seed": 0,
                                      "backend": "completions", "max_concurrency": 2}
        assert [r["rate"] for r in report["rows"]] == ["inf", 20.0]
        for row in report["rows"]:
            assert row["completed"] == 5 and row["failed"] == 0 and row["client_cpu"] > 0
            assert row["output_len_source"] == "usage"
            assert all(row[f"{n}_ms_p{q}"] > 0 for n in ("ttft", "itl", "tpot", "e2e")
                       for q in (50, 99))

        # Each request, by both backends: usage's count is max_tokens (ignore_eos).
        requests = bench.workload(3, (8, 32), (4, 8), 500, 1)
        texts = [(f"Count to {n}: one two", n) for _, n in requests]
        for backend, prompts in (("completions", requests), ("chat", texts)):
            run = bench.run(bench.Target(port=s.port, backend=backend, timeout=60),
                            prompts, float("inf"), progress=False)
            assert 0 < run.client_cpu < 4  # CPU seconds per second: one thread, some C
            for r, (_, max_tokens) in zip(run.results, requests):
                assert r.ok, r.error
                assert r.from_usage and r.output_tokens == max_tokens
                assert 0 < r.ttft <= r.e2e
                # One text chunk per token at most, not exactly: the detokenizer holds back a
                # token whose text ends in an incomplete character, and special tokens have
                # no text, so random output can come in fewer chunks than tokens.
                assert len(r.itl) <= r.output_tokens - 1
        pids = s.pids()
        start = time.monotonic()
        assert s.stop() == 0
        assert gone(pids, 10 - (time.monotonic() - start))
    finally:
        if s.proc.poll() is None:
            s.proc.kill()

