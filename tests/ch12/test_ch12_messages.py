"""Chapter 12: every message survives msgpack, bad frames are refused with a clear error, and
the ZMQ queues carry messages between real processes."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    MessageError,
    TokenizeMsg,
    UserMsg,
    UserReply,
    decode,
    encode,
)
from minisgl.message.transport import (
    IpcNamespace,
    ZmqAsyncPullQueue,
    ZmqAsyncPushQueue,
    ZmqPubQueue,
    ZmqPullQueue,
    ZmqPushQueue,
    ZmqSubQueue,
)

from reference import hf_greedy

# --- values ------------------------------------------------------------------------------------

uids = st.integers(0, 2**63 - 1)
texts = st.text(max_size=40)  # any unicode: Chinese, emoji, NUL, lone surrogates excluded
params = st.builds(SamplingParams,
                   temperature=st.floats(0.0, 2.0), top_k=st.sampled_from([-1, 1, 5, 50]),
                   top_p=st.floats(0.01, 1.0), ignore_eos=st.booleans(),
                   max_tokens=st.integers(1, 4096))
chats = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                        "content": texts}), min_size=1, max_size=4)
prompts = st.one_of(texts, chats, st.lists(st.integers(0, 2**31 - 1), max_size=50))
reasons = st.sampled_from([None, "stop", "length", "error"])
DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool, torch.uint8]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 64))
    values = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    return torch.tensor(values).to(dtype)


tokenize_msgs = st.builds(TokenizeMsg, uids, prompts, params, st.lists(texts, max_size=3))
detokenize_msgs = st.builds(DetokenizeMsg, uids, st.integers(-1, 200_000), st.booleans(),
                            reasons, st.one_of(st.none(), texts))
user_msgs = st.builds(UserMsg, uids, tensors(), params)
replies = st.builds(UserReply, uids, texts, st.booleans(), reasons, st.integers(0, 10**6),
                    st.integers(0, 10**6), st.one_of(st.none(), texts))
messages = st.one_of(
    tokenize_msgs, detokenize_msgs, st.builds(AbortMsg, uids), user_msgs,
    st.builds(AbortBackendMsg, uids), st.just(ExitMsg()), replies,
    st.builds(BatchTokenizerMsg, st.lists(st.one_of(tokenize_msgs, detokenize_msgs,
                                                    st.builds(AbortMsg, uids)), max_size=4)),
    st.builds(BatchBackendMsg, st.lists(st.one_of(user_msgs, st.builds(AbortBackendMsg, uids),
                                                  st.just(ExitMsg())), max_size=4)),
    st.builds(BatchFrontendMsg, st.lists(replies, max_size=4)),
)


def same(a: object, b: object) -> bool:
    """Equality that compares tensors by dtype and values, inside dataclasses and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


# --- the codec ---------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_type_round_trips(msg: object) -> None:
    back = decode(encode(msg), type(msg))
    assert same(back, msg)


def test_tensor_arrives_as_its_own_writable_copy() -> None:
    ids = torch.arange(5, dtype=torch.int32)
    back = decode(encode(UserMsg(1, ids, SamplingParams())), UserMsg).input_ids
    back[0] = 99  # frombuffer over msgpack's bytes would be read-only; ours is a copy
    assert back.dtype == torch.int32 and back.tolist() == [99, 1, 2, 3, 4] and ids[0] == 0


def test_a_dict_that_looks_like_a_tag_stays_a_dict() -> None:
    """A client's chat message is data: a "__type__" key in it must not turn it into a message."""
    chat = [{"role": "user", "content": "hi", "__type__": "ExitMsg"}]
    back = decode(encode(TokenizeMsg(7, chat, SamplingParams(), [])), TokenizeMsg)
    assert back.prompt == chat


@pytest.mark.parametrize("frame, why", [
    (b"", "not a msgpack message"),
    (b"\xc1", "not a msgpack message"),  # 0xc1 is never used by msgpack
    (b"\x00 not msgpack", "not a msgpack message"),  # a valid 0 followed by junk
    (encode(ExitMsg())[:-1], "not a msgpack message"),  # cut short
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["NoSuchMsg", {}]))), "unknown message type"),
    (msgpack.packb(msgpack.ExtType(9, b"")), "unknown msgpack extension code 9"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["AbortMsg", {}]))), "bad AbortMsg"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(
        ["SamplingParams", {"temperature": -1.0}]))), "temperature must be >= 0"),
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb(["complex64", b""]))), "unknown tensor dtype"),
    (msgpack.packb({"__type__": "ExitMsg"}), "expected a ExitMsg, got a dict"),
])
def test_malformed_frames_are_refused_with_a_reason(frame: bytes, why: str) -> None:
    with pytest.raises(MessageError, match=why):
        decode(frame, ExitMsg)


def test_wrong_message_type_is_refused() -> None:
    with pytest.raises(MessageError, match="expected a UserMsg, got a AbortMsg"):
        decode(encode(AbortMsg(1)), UserMsg)


def test_what_cannot_be_sent_is_refused_at_the_sender() -> None:
    @dataclasses.dataclass
    class Unregistered:
        x: int

    with pytest.raises(TypeError, match="register it with @message"):
        encode(AbortMsg(Unregistered(1)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only 1-D CPU tensors"):
        encode(UserMsg(1, torch.zeros(2, 2, dtype=torch.int32), SamplingParams()))


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_a_decoded_request_gives_hf_tokens(arch: str, model_dir: Callable[[str], Path],
                                          make_llm: Callable) -> None:
    """What reaches the scheduler process is the request itself: the engine, fed the decoded
    UserMsg, produces HF's greedy tokens, for every architecture the server can load."""
    path = model_dir(arch)
    prompt = [7, 300, 41, 99, 5, 260, 18]
    sent = UserMsg(3, torch.tensor(prompt, dtype=torch.int32), SamplingParams(max_tokens=8))
    got = decode(encode(sent), UserMsg)
    llm = make_llm(path, cache_type="naive")
    out = llm.generate([got.input_ids.tolist()], got.sampling_params)[0]["token_ids"]
    assert out == hf_greedy(path, prompt, 8)[0]


# --- queues ------------------------------------------------------------------------------------

def test_namespaces_are_private_and_removed() -> None:
    a, b = IpcNamespace(), IpcNamespace()
    try:
        assert a.addr("scheduler") != b.addr("scheduler")
        with ZmqPullQueue(a.addr("q"), bind=True, expected=AbortMsg):
            assert (a.root / "q").exists()  # the socket file lives in the private folder
    finally:
        a.remove()
        b.remove()
    assert not a.root.exists() and not b.root.exists()


def _echo(inbox: str, outbox: str) -> None:
    """A child process: sends back every message until ExitMsg, then how many frames it refused."""
    with ZmqPullQueue(inbox, bind=True, expected=BatchBackendMsg | ExitMsg) as pull, \
            ZmqPushQueue(outbox, bind=False) as push:
        while not isinstance(msg := pull.get(), ExitMsg):
            push.put(msg)
        push.put(BatchFrontendMsg([UserReply(-1, "refused", True, prompt_tokens=pull.refused)]))
        # the queues close with linger 0: had the connection to outbox not come up yet, closing
        # would drop every echo (it happened once under load); wait up to 30 s for them to leave
        push.socket.setsockopt(zmq.LINGER, 30_000)


def test_queue_between_two_processes_survives_a_malformed_frame() -> None:
    ns = IpcNamespace()
    try:
        with ZmqPullQueue(ns.addr("out"), bind=True, expected=BatchBackendMsg | BatchFrontendMsg) \
                as pull, ZmqPushQueue(ns.addr("in"), bind=False) as push:
            child = mp.get_context("spawn").Process(target=_echo,
                                                    args=(ns.addr("in"), ns.addr("out")))
            child.start()
            sent = BatchBackendMsg([UserMsg(i, torch.arange(i, dtype=torch.int32),
                                            SamplingParams(max_tokens=i + 1)) for i in range(3)])
            push.put(sent)
            push.socket.send(b"\xc1 garbage")  # refused by the child, which keeps serving
            push.put(BatchBackendMsg([AbortBackendMsg(5)]))
            push.put(ExitMsg())
            got = [pull.get(timeout_ms=60_000) for _ in range(3)]
            child.join(timeout=30)
        assert same(got[0], sent) and same(got[1], BatchBackendMsg([AbortBackendMsg(5)]))
        assert isinstance(got[2], BatchFrontendMsg) and got[2].data[0].prompt_tokens == 1
        assert child.exitcode == 0
    finally:
        ns.remove()


def test_pull_queue_skips_bad_frames_and_times_out() -> None:
    ns = IpcNamespace()
    try:
        with ZmqPullQueue(ns.addr("q"), bind=True, expected=AbortMsg) as pull, \
                ZmqPushQueue(ns.addr("q"), bind=False) as push:
            push.socket.send(b"junk")
            push.put(ExitMsg())  # well-formed, but not what this queue carries
            push.put(AbortMsg(3))
            assert pull.get(timeout_ms=5000) == AbortMsg(3)
            assert pull.refused == 2
            assert pull.empty() and pull.get(timeout_ms=10) is None
    finally:
        ns.remove()


def test_async_queues() -> None:
    ns = IpcNamespace()

    async def run() -> list[UserReply]:
        with ZmqAsyncPullQueue(ns.addr("a"), bind=True, expected=UserReply) as pull, \
                ZmqAsyncPushQueue(ns.addr("a"), bind=False) as push:
            await push.put(b"junk-that-is-bytes")  # encodes fine, but is not a UserReply
            for i in range(3):
                await push.put(UserReply(i, "你好👋"[: i + 1], i == 2))
            return [await asyncio.wait_for(pull.get(), 10) for _ in range(3)]

    try:
        got = asyncio.run(run())
        assert [r.incremental_output for r in got] == ["你", "你好", "你好👋"]
    finally:
        ns.remove()


def test_pub_sub_reaches_every_subscriber() -> None:
    ns = IpcNamespace()
    try:
        with ZmqPubQueue(ns.addr("tp"), bind=True) as pub, \
                ZmqSubQueue(ns.addr("tp"), bind=False, expected=BatchBackendMsg) as s1, \
                ZmqSubQueue(ns.addr("tp"), bind=False, expected=BatchBackendMsg) as s2:
            hello = BatchBackendMsg([])
            deadline = time.monotonic() + 10  # a subscriber misses what was sent before it joined
            while not (s1.socket.poll(50) and s2.socket.poll(50)) and time.monotonic() < deadline:
                pub.put(hello)
            for s in (s1, s2):
                while s.socket.poll(100):
                    s.get()
            msg = BatchBackendMsg([AbortBackendMsg(1)])
            pub.put_raw(encode(msg))  # rank 0 forwards the frame it received, undecoded
            assert s1.get() == msg and s2.get() == msg
    finally:
        ns.remove()
