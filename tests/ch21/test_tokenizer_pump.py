"""Chapter 21: the tokenizer process handles one frame per wake-up. A burst of requests queued
at once reaches the scheduler one request at a time, each as soon as it is tokenized, and the
scheduler's tokens queued behind the burst get their replies in their turn."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from minisgl.core import SamplingParams
from minisgl.message import BatchTokenizerMsg, DetokenizeMsg, TokenizeMsg, UserMsg
from minisgl.tokenizer.server import TokenizerServer, pump


class Frames:
    """The inbox: frames in arrival order; get() takes the next, None when empty."""

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames

    def get(self, timeout_ms: int | None = None) -> Any:
        return self.frames.pop(0) if self.frames else None


class Sent(list):
    """An outbox: what was put, in order."""

    def put(self, msg: Any) -> None:
        self.append(msg)


def test_a_burst_goes_on_one_request_at_a_time(model_dir: Callable[[str], Path]) -> None:
    server = TokenizerServer(str(model_dir("tiny-qwen3")), forward_setups=False)
    chat = [{"role": "user", "content": "Hello there"}]
    inbox = Frames([TokenizeMsg(uid, chat, SamplingParams(max_tokens=4), []) for uid in range(3)])
    token = server.tokenize.tokenizer.encode("Hi")[0]
    inbox.frames.append(BatchTokenizerMsg([DetokenizeMsg(0, token, True, "length")]))
    backend, frontend = Sent(), Sent()
    pump(server, inbox, backend, frontend, None)  # type: ignore[arg-type]
    assert len(inbox.frames) == 3  # one frame taken, the rest still queued
    assert [[m.uid for m in b.data] for b in backend] == [[0]]  # and request 0 already sent on
    assert all(isinstance(m, UserMsg) for b in backend for m in b.data)
    while inbox.frames:
        pump(server, inbox, backend, frontend, None)  # type: ignore[arg-type]
    assert [[m.uid for m in b.data] for b in backend] == [[0], [1], [2]]
    assert [(r.uid, r.finished) for b in frontend for r in b.data] == [(0, True)]  # its reply
