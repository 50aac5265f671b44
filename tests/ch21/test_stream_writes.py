"""The API server's streams under load: the replies that reached a stream while its reader was
busy go out in one write, in order, and a reader that keeps up still writes one per reply."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from minisgl.message import UserReply
from minisgl.server import api_server
from minisgl.server.frontend import FrontendManager, _Inbox
from minisgl.server.protocol import Response


def _events(writes: list[bytes]) -> list[str]:
    return [e for w in writes for e in w.decode().split("\n\n") if e]


def _deliver(m: FrontendManager, *replies: UserReply) -> None:
    """What the reply listener does with one message from the tokenizer."""
    for r in replies:
        inbox = m.inboxes[r.uid]
        inbox.replies.append(r)
        inbox.event.set()


async def _open(m: FrontendManager, *replies: UserReply):  # type: ignore[no-untyped-def]
    """A request in flight (uid 0) whose first replies have come: its batches and the first."""
    m.inboxes[0], m.requests = _Inbox(), 1
    batches = m.batches(0)
    _deliver(m, *replies)
    return batches, await batches.__anext__()


def _run(tmp_path: Path, body) -> list[bytes]:  # type: ignore[no-untyped-def]
    async def main() -> list[bytes]:
        m = FrontendManager(f"ipc://{tmp_path}/to", True, f"ipc://{tmp_path}/from")
        try:
            return await body(m)
        finally:
            m.close()
    return asyncio.run(main())


def test_replies_that_came_together_go_out_in_one_write(tmp_path: Path) -> None:
    async def body(m: FrontendManager) -> list[bytes]:
        uid = 0
        batches, first = await _open(m, UserReply(uid, "a", False))
        events = api_server._openai_events(Response(True, "m"), first, batches, False)
        writes = [await events.__anext__()]  # role and "a": one write
        # three replies reach the stream before its reader runs again, the last one finished
        _deliver(m, UserReply(uid, "b", False), UserReply(uid, "c", False),
                 UserReply(uid, "", True, "length", prompt_tokens=2, completion_tokens=3))
        writes += [w async for w in events]
        return writes

    writes = _run(tmp_path, body)
    assert len(writes) == 2
    events = _events(writes)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"},
                      {"content": "c"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _events(writes[:1]) == events[:2]  # the role and the first text went out first


def test_a_reader_that_keeps_up_writes_each_reply_as_it_comes(tmp_path: Path) -> None:
    async def body(m: FrontendManager) -> list[bytes]:
        uid = 0
        batches, first = await _open(m, UserReply(uid, "x", False))
        events = api_server._generate_events(first, batches)
        writes = []
        for text in ("y", "z"):
            writes.append(await events.__anext__())
            _deliver(m, UserReply(uid, text, False))
        writes.append(await events.__anext__())
        _deliver(m, UserReply(uid, "", True, "stop", prompt_tokens=1, completion_tokens=3))
        writes += [w async for w in events]
        return writes

    writes = _run(tmp_path, body)
    texts = [[json.loads(e.removeprefix("data: ")).get("text") for e in _events([w])
              if e != "data: [DONE]"] for w in writes]
    assert texts == [["x"], ["y"], ["z"], [""]]
    assert writes[-1].endswith(b"data: [DONE]\n\n")


def test_a_reply_after_the_finished_one_is_not_sent(tmp_path: Path) -> None:
    """A failure can file an error after a request's last reply, before its reader wakes: the
    stream ends at the finished reply, as if the error had come later."""
    async def body(m: FrontendManager) -> list[bytes]:
        uid = 0
        m.inboxes[uid], m.requests = _Inbox(), 1
        _deliver(m, UserReply(uid, "t", False), UserReply(uid, "", True, "stop"))
        m.end_all("a process died")
        batches = m.batches(uid)
        first = await batches.__anext__()
        assert [r.finish_reason for r in first] == [None, "stop"]
        return [w async for w in api_server._generate_events(first, batches)]

    writes = _run(tmp_path, body)
    assert len(writes) == 1 and b"a process died" not in writes[0]
