"""Chapter 15: the server against a hostile but fair client. A table of hostile bodies (each
answered with a 4xx in OpenAI's shape, the server serving normally after each), the two requests
that used to stop the scheduler, the API key, Host and Content-Type checks, every limit and its
flag (body size, header and body read timeouts, connections, queued requests), readiness, the
drain on SIGTERM, and kill -9 of each child under load (TP=3: chapter 16's tests)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from serving import Server, gone

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
MSGS = [{"role": "user", "content": "Tell me a story."}]
BASE = {CHAT: {"messages": MSGS, "max_tokens": 2},
        COMPLETIONS: {"prompt": [5, 6, 7], "max_tokens": 2},
        GENERATE: {"prompt": [5, 6, 7], "max_tokens": 2}}
BIG = [2**63, 2**64, 2**64 + 5, 10**30, -(2**63) - 1]


def _cases() -> list[tuple[str, str, bytes, int]]:
    """(what, path, raw body, status): every value here is one a client can send."""
    out: list[tuple[str, str, bytes, int]] = []

    def add(what: str, path: str, body: dict[str, Any] | bytes, status: int = 400) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append((what, path, raw, status))

    for path, base in BASE.items():
        short = path.rsplit("/", 1)[-1]
        for field, values in {
            "max_tokens": [*BIG, 0, -1, 1.5, "5", True, [], {}, 10**6],
            "top_k": [*BIG, 0, -2, 2.5, "3", False],
            "temperature": [-1, -1e-9, "1", True, [], {"x": 1}],
            "top_p": [0, -0.1, 1.5, "0.5", [], True],
            "stop": [[""], "", ["a", "b", "c", "d", "e"], [1], {"a": 1}, 5],
            "stream": ["yes", 1, []], "ignore_eos": ["no", 0],
            "cache_salt": ["", 5, ["a"]], "model": [5, ["m"]],
            "n": [2, 0, "1"], "seed": [1, 2**70], "logprobs": [True, 1, 0],
            "top_logprobs": [2], "presence_penalty": [0.5, -2], "frequency_penalty": [1],
            "logit_bias": [{"5": 10}], "response_format": [{"type": "json_object"},
                                                          {"type": "json_schema"}],
            "tools": [[{"type": "function", "function": {"name": "f"}}]],
            "tool_choice": ["auto", "required"], "functions": [[{"name": "f"}]],
            "best_of": [2], "echo": [True], "suffix": ["x"], "audio": [{"voice": "x"}],
            "max_token": [5], "foo": [None, 1], "stream_options": [{"include_usage": True}],
        }.items():
            for v in values:
                add(f"{short} {field}={str(v)[:20]}", path, {**base, field: v})
        for raw in [b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe{}", b"{" * 100_000,
                    b"[" * 100_000, b'{"a":' * 50_000, b'{"max_tokens": NaN}',
                    b'{"temperature": Infinity}', b'{"temperature": 1e400}',
                    b'{"max_tokens": 1, "max_tokens": "x"}']:
            add(f"{short} raw {raw[:12]!r}", path, raw)
        add(f"{short} {{}}", path, {})
    for ids in [[2**63], [2**64], [-1], [10**6], [1.5], [True], [[1, 2]], [], [""], ["a", "b"]]:
        for path in (COMPLETIONS, GENERATE):
            add(f"{path} prompt={str(ids)[:20]}", path, {"prompt": ids, "max_tokens": 2})
    for messages in [[], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}],
                     [{"role": "user", "content": 123}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                     [{"role": "user", "content": "x", "tool_calls": []}],
                     [{"role": "user", "content": [{"type": "text"}]}], [None], [[]]]:
        add(f"chat messages={str(messages)[:24]}", CHAT, {"messages": messages})
    add("chat max_completion_tokens 2^64", CHAT, {"messages": MSGS,
                                                  "max_completion_tokens": 2**64})
    add("completions prompt + max_tokens over the context", COMPLETIONS,
        {"prompt": [5] * 300, "max_tokens": 300})
    add("completions prompt of the whole context", COMPLETIONS, {"prompt": [5] * 512})
    add("chat max_tokens = the context", CHAT, {"messages": MSGS, "max_tokens": 512})
    return out


CASES = _cases()


def normal(s: Server, **headers: str) -> int:
    status, _ = s.request("POST", COMPLETIONS, {"prompt": [5, 6], "max_tokens": 1},
                          timeout=30, headers=headers)
    return status


def error_of(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_more_than_200_hostile_bodies_each_a_4xx_and_the_server_serves_after_each(
        server: Server) -> None:
    assert len(CASES) >= 200
    seen: dict[int, int] = {}
    for what, path, raw, status in CASES:
        got, answer = server.request("POST", path, raw, timeout=30)
        assert got == status, (what, answer[:300])
        assert "Traceback" not in error_of(answer)["message"], what
        seen[got] = seen.get(got, 0) + 1
        assert normal(server) == 200, what
    print(f"{len(CASES)} hostile bodies: statuses {seen}")
    stats = server.stats()  # nothing leaked: every row free, every page free or cached
    assert stats["idle"] and stats["integrity"] == "ok", stats
    assert "Traceback" not in server.log.read_text()


def test_the_top_k_pair_that_stopped_the_scheduler(server: Server) -> None:
    """The report's pair: top_k 2^63 (past int64) sent with top_k 5. The first is a 400 now;
    2^63 - 1 with 5 is served, a k at or above the vocabulary meaning no cut."""
    body = {"messages": MSGS, "max_tokens": 16, "temperature": 1}
    for ks, statuses in [([2**63, 5, 2**63, 5], [400, 200, 400, 200]),
                         ([2**63 - 1, 5, 2**63 - 1, 5], [200] * 4)]:
        with ThreadPoolExecutor(4) as pool:  # batched together by the scheduler
            answers = list(pool.map(
                lambda k: server.request("POST", CHAT, {**body, "top_k": k}), ks))
        assert [a[0] for a in answers] == statuses, answers
        assert all(error_of(raw)["param"] == "top_k" for got, raw in answers if got == 400)
    assert normal(server) == 200


def test_null_means_the_default_as_in_openai(server: Server) -> None:
    for field in ("temperature", "top_p", "n", "stream", "max_tokens", "stop", "seed",
                  "logprobs", "response_format", "tools", "stream_options"):
        got, raw = server.request("POST", CHAT, {"messages": MSGS, "max_tokens": 2, field: None})
        assert got == 200, (field, raw)
    # the values that ask for nothing are accepted too: clients that send every default work
    got, raw = server.request("POST", CHAT, {
        "messages": MSGS, "max_tokens": 2, "n": 1, "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "response_format":
        {"type": "text"}, "logprobs": False, "user": "u1", "parallel_tool_calls": False})
    assert got == 200, raw


def test_refusals_name_the_field_and_say_the_numbers(server: Server) -> None:
    got, raw = server.request("POST", CHAT, {"messages": MSGS, "response_format":
                                             {"type": "json_object"}})
    assert got == 400 and error_of(raw)["param"] == "response_format"
    got, raw = server.request("POST", COMPLETIONS, {"prompt": [5] * 300, "max_tokens": 300})
    assert got == 400 and "300 tokens and max_tokens is 300: 600 in all" in raw.decode()
    got, raw = server.request("POST", CHAT, {"messages": MSGS, "stream_options":
                                             {"include_usage": True}})
    assert got == 400 and error_of(raw)["param"] == "stream_options"
    got, raw = server.request("POST", CHAT, {"messages": MSGS, "max_token": 5})
    assert got == 400 and error_of(raw)["param"] == "max_token"


def test_methods_paths_and_the_openapi_schema(server: Server) -> None:
    got, raw = server.request("GET", CHAT)
    assert got == 405 and error_of(raw)
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    c.request("DELETE", "/v1/models")
    r = c.getresponse()
    assert r.status == 405 and r.getheader("Allow") == "GET"
    r.read()
    got, raw = server.request("GET", "/v1/nothing")
    assert got == 404 and error_of(raw)["type"] == "not_found_error"
    got, raw = server.request("GET", "/openapi.json")
    schema = json.loads(raw)
    for path in (CHAT, COMPLETIONS, GENERATE):
        op = schema["paths"][path]["post"]
        assert "$ref" in op["requestBody"]["content"]["application/json"]["schema"], path
        assert {"200", "400", "401", "413", "415", "429", "503"} <= set(op["responses"])
        assert "422" not in op["responses"]


# --- the key, Host, Content-Type and the limits ---------------------------------------------------

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def guarded(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(model, tmp_path_factory.mktemp("guarded"), "--api-key", KEY,
               "--max-request-bytes", "4096", "--max-connections", "12", "--header-timeout", "1",
               "--body-timeout", "1", "--max-running-requests", "2", "--max-queued-requests", "1",
               held_s=2)
    s.starting = []  # what /v1/models answered while the server started (its scheduler held)
    while True:
        try:
            status, _ = s.request("GET", "/v1/models", timeout=5,
                                  headers={"Authorization": f"Bearer {KEY}"})
            s.starting.append(status)
            if status == 200:
                break
        except OSError:
            assert s.proc.poll() is None, s.log.read_text()[-2000:]
        time.sleep(0.05)
    s.wait_ready = lambda: []  # type: ignore[method-assign]
    yield s
    s.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_no_route_but_health_answers_before_the_server_is_ready(guarded: Server) -> None:
    assert 503 in guarded.starting and guarded.starting[-1] == 200
    assert guarded.starting.index(200) == len(guarded.starting) - 1


def test_the_api_key(guarded: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        got, raw = guarded.request("POST", COMPLETIONS, {"prompt": [5], "max_tokens": 1},
                                   headers=headers)
        assert got == 401 and error_of(raw)["code"] == "invalid_api_key", headers
    assert normal(guarded, **AUTH) == 200
    got, raw = guarded.request("GET", "/health")  # the probe needs no key, and shows no PIDs
    assert got == 200 and json.loads(raw) == {"status": "ready"}
    assert guarded.request("GET", "/debug/processes")[0] == 401
    assert guarded.request("GET", "/debug/scheduler")[0] == 401
    assert guarded.request("GET", "/debug/processes", headers=AUTH)[0] == 200
    assert guarded.request("GET", "/openapi.json")[0] == 200


def test_debug_routes_are_off_unless_asked_for(model: Path, tmp_path: Path) -> None:
    s = Server(model, tmp_path, debug=False)
    try:
        s.wait_ready()
        assert s.processes == {}
        assert s.request("GET", "/debug/processes")[0] == 404
        assert s.request("GET", "/debug/scheduler")[0] == 404
    finally:
        s.stop()


def test_host_and_content_type(guarded: Server) -> None:
    bad_host = guarded.request("POST", COMPLETIONS, {"prompt": [5], "max_tokens": 1},
                               headers={**AUTH, "Host": "attacker.example"})
    assert bad_host[0] == 400 and error_of(bad_host[1])["param"] == "host"
    for host in (f"localhost:{guarded.port}", f"127.0.0.1:{guarded.port}",
                 f"[::1]:{guarded.port}"):
        assert normal(guarded, **AUTH, Host=host) == 200, host
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
        got, raw = guarded.request("POST", COMPLETIONS, b'{"prompt": [5], "max_tokens": 1}',
                                   headers={**AUTH, "Content-Type": kind})
        assert got == 415 and error_of(raw)["param"] == "content-type", kind
    assert normal(guarded, **AUTH, **{"Content-Type": "application/json; charset=utf-8"}) == 200


def _raw(port: int, data: bytes, wait_s: float = 0.0, close: bool = False) -> bytes:
    """Send data on a fresh connection, wait, and read whatever comes until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        if close:
            return b""
        time.sleep(wait_s)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_body_size_and_read_timeouts(guarded: Server) -> None:
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    got, raw = guarded.request("POST", COMPLETIONS, big, headers=AUTH)
    assert got == 413 and "--max-request-bytes" in error_of(raw)["message"]
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\n")
    chunked = head + "Transfer-Encoding: chunked\r\n\r\n" + "".join(
        f"{1000:x}\r\n{'y' * 1000}\r\n" for _ in range(6)) + "0\r\n\r\n"
    answer = _raw(guarded.port, chunked.encode())  # no Content-Length: counted as it comes
    assert answer.startswith(b"HTTP/1.1 413") and b'"error"' in answer, answer[:300]
    start = time.monotonic()  # slowloris: headers that never end
    answer = _raw(guarded.port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    assert answer.startswith(b"HTTP/1.1 408") and b'"error"' in answer
    assert time.monotonic() - start < 5
    answer = _raw(guarded.port, b"")  # a connection that says nothing at all
    assert answer.startswith(b"HTTP/1.1 408")
    answer = _raw(guarded.port, (head + "Content-Length: 100\r\n\r\n{\"pro").encode())
    assert b" 408 " in answer.split(b"\r\n")[0] and b'"error"' in answer, answer[:300]
    for _ in range(5):  # clients that go away mid-body: one log line each, no traceback
        _raw(guarded.port, (head + "Content-Length: 100\r\n\r\n{\"pro").encode(), close=True)
    time.sleep(0.5)
    log = guarded.log.read_text()
    assert "Traceback" not in log and log.count("went away before its request") >= 5
    assert normal(guarded, **AUTH) == 200


def test_connection_limit(guarded: Server) -> None:
    socks = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(12)]
    try:
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as extra:
            answer = extra.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert normal(guarded, **AUTH) == 200


def test_queued_requests_beyond_the_limit_get_429(guarded: Server) -> None:
    body = {"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True}

    def one(_: int) -> tuple[int, str | None]:
        c = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=60)
        c.request("POST", COMPLETIONS, json.dumps(body), {**AUTH,
                                                          "Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, r.getheader("Retry-After")

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    assert sorted({s for s, _ in got}) == [200, 429], got
    assert all(after == "1" for s, after in got if s == 429)
    assert sum(s == 200 for s, _ in got) >= 3  # 2 running + 1 queued at least were taken
    assert normal(guarded, **AUTH) == 200


# --- drain on SIGTERM, and children killed under load --------------------------------------------

def _stream(s: Server, max_tokens: int, out: list[Any], chat: bool = False) -> None:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body |= {"messages": MSGS} if chat else {"prompt": [7, 8, 9]}
    try:
        out.append(s.request("POST", CHAT if chat else COMPLETIONS, body, timeout=60))
    except OSError as e:  # a closed connection counts as an end only for killed children
        out.append((0, repr(e).encode()))


def _events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n"), text[-300:]
    return [e.removeprefix("data: ") for e in text[:-2].split("\n\n")]


def _ended_well(status: int, raw: bytes) -> str:
    """"done" (finish_reason and [DONE]) or "error" (an error event, then [DONE]; or a 503
    JSON error for a request that had no token yet when it was stopped); else fails."""
    if status == 503:
        assert "shutting down" in error_of(raw)["message"]
        return "error"
    assert status == 200, raw[:300]
    events = _events(raw)
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        return "error"
    assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
    return "done"


def _counted_stream(s: Server, max_tokens: int, chat: bool, seen: list[int], i: int,
                    out: list[Any]) -> None:
    """A stream whose events are counted as they come (seen[i])."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body |= {"messages": MSGS} if chat else {"prompt": [7, 8, 9]}
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
    conn.request("POST", CHAT if chat else COMPLETIONS, json.dumps(body),
                 {"Content-Type": "application/json"})
    r, raw = conn.getresponse(), b""
    while line := r.readline():
        raw += line
        seen[i] += line.startswith(b"data: ")
    out.append((r.status, raw))


def test_sigterm_drains_16_streams_none_cut_silently(model_dir: Callable[[str], Path],
                                                     tmp_path: Path) -> None:
    """8 streams of 32 tokens, 8 of 1,900. The signal comes once each short one has 20 events
    (or has ended: a token that completes no character sends no event, so 32 tokens can come as
    24 events): they finish within the drain (a dozen more steps in 16 s, even on a CPU that
    other tests keep busy), the long ones cannot (some 1,870 steps in 16 s would be 8.6 ms each
    for a batch of 16; reading SmolLM2's float32 weights once takes longer than that)."""
    s = Server(model_dir("SmolLM2-135M-Instruct"), tmp_path, "--shutdown-timeout", "16",
               "--max-seq-len-override", "2048", "--num-pages", "32768")  # all 16 admitted
    s.wait_ready(timeout_s=300)
    results: list[Any] = []
    seen = [0] * 16
    short = [i for i in range(16) if i % 2]
    threads = [threading.Thread(target=_counted_stream, args=(
        s, 32 if i in short else 1900, i % 3 == 0, seen, i, results)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while (any(seen[i] < 20 and threads[i].is_alive() for i in short)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # taken no more: 503, or refused once the listener is closed
        assert s.request("POST", COMPLETIONS, {"prompt": [5], "max_tokens": 1},
                         timeout=5)[0] == 503
    except OSError:
        pass
    for t in threads:
        t.join(timeout=60)
    assert s.proc.wait(timeout=40) == 0
    ends = [_ended_well(status, raw) for status, raw in results]
    assert len(ends) == 16 and "done" in ends and "error" in ends, ends
    assert gone(s.pids(), 10)
    assert not [p for p in tmp_path.iterdir() if p.name != "server.log"]


def test_a_second_signal_stops_at_once(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """The stream is still going at both signals (400 tokens of SmolLM2 take seconds on a CPU,
    where tiny-qwen3's can end within the 1.5 s): the first starts a drain that would wait for
    it, the second stops the server at once."""
    s = Server(model_dir("SmolLM2-135M-Instruct"), tmp_path, "--shutdown-timeout", "60")
    s.wait_ready(timeout_s=300)
    results: list[Any] = []
    t = threading.Thread(target=_stream, args=(s, 400, results))
    t.start()
    time.sleep(1.0)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert t.is_alive(), f"the stream ended before the second signal: {results}"
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=15) == 0 and time.monotonic() - start < 10
    t.join(timeout=10)
    assert gone(s.pids(), 10)


@pytest.mark.parametrize("victim,flags", [("scheduler", []), ("tokenizer", []),
                                          ("detokenizer", ["--num-tokenizer", "1"]),
                                          ("tokenizer-0", ["--num-tokenizer", "1"])])
def test_kill_9_of_a_child_under_load(victim: str, flags: list[str], model: Path,
                                      tmp_path: Path) -> None:
    _kill_under_load(Server(model, tmp_path, *flags), victim, tmp_path)


def _kill_under_load(s: Server, victim: str, tmp_path: Path) -> None:
    try:
        s.wait_ready(timeout_s=300)
        results: list[Any] = []
        threads = [threading.Thread(target=_stream, args=(s, 300, results)) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(s.processes[victim], signal.SIGKILL)
        assert s.proc.wait(timeout=30) == 1
        for t in threads:
            t.join(timeout=30)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert f"the {victim} process" in s.log.read_text()
    assert gone(s.pids(), 10)
    assert not [p for p in tmp_path.iterdir() if p.name != "server.log"]  # no ipc files
    for status, raw in results:  # an error event and [DONE]; a 503 if no token came yet; or,
        if status == 503:          # when the launcher went first, the connection closed
            assert f"the {victim} process" in error_of(raw)["message"]
        elif status:
            assert _ended_well(status, raw) in ("error", "done")
