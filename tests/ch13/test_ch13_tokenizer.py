"""Chapter 13: prompts become the token ids HF's tokenizer gives, streamed tokens become text
that never shows a broken character, an EOS or a stop string, and the tokenizer process serves
real sockets in both layouts (one process; a worker plus a detokenizer)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    DetokenizeSetupMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.message.transport import IpcNamespace, ZmqPullQueue, ZmqPushQueue
from minisgl.tokenizer import DetokenizeManager, TokenizeManager, tokenizer_worker
from minisgl.tokenizer.server import TokenizerServer

from reference import hf_greedy

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，2+2=?"}]
# English, Chinese and emoji (several of them 4 bytes, or several code points joined)
PIECES = st.sampled_from(list("abc xyz.,!\n") + list("你好世界中文字") + ["🌍", "😀", "👍🏽", "é"])


def texts(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    return st.lists(PIECES, min_size=min_size, max_size=max_size).map("".join)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Callable[[str], Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen3"))


# --- tokenize ----------------------------------------------------------------------------------

def test_prompts_become_hf_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    manager = TokenizeManager(tokenizer)

    def ids(prompt: object) -> list[int]:
        return manager.tokenize(TokenizeMsg(0, prompt, SamplingParams(), [])).tolist()  # type: ignore[arg-type]

    templated = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    assert ids(CHAT) == list(templated)  # the generation prompt is there, no special token twice
    assert ids("The capital of France is") == tokenizer("The capital of France is").input_ids
    assert ids([5, 0, 511]) == [5, 0, 511]
    assert manager.tokenize(TokenizeMsg(0, [1, 2], SamplingParams(), [])).dtype == torch.int32


@pytest.mark.parametrize("prompt, why", [
    ("", "empty"), ([], "empty"), ([3, 512], r"in \[0, 512\)"), ([-1], r"in \[0, 512\)")])
def test_bad_prompts_are_refused(tokenizer: PreTrainedTokenizerBase, prompt: object,
                                 why: str) -> None:
    with pytest.raises(ValueError, match=why):
        TokenizeManager(tokenizer).tokenize(TokenizeMsg(0, prompt, SamplingParams(), []))  # type: ignore[arg-type]


# --- detokenize --------------------------------------------------------------------------------

def stream(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: list[str] | None = None,
           reason: str = "length") -> tuple[list[UserReply], list[bool]]:
    """Feed ids one message each, the last one finishing the request, as the scheduler does."""
    manager = DetokenizeManager(tokenizer)
    manager.add(7, 3, stop or [])
    replies, aborts = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        reply, abort = manager.detokenize(DetokenizeMsg(7, token, last, reason if last else None))
        if reply is not None:
            replies.append(reply)
        aborts.append(abort)
    assert not manager.status  # nothing left behind
    return replies, aborts


@settings(max_examples=150, deadline=None, derandomize=True)
@given(texts(1, 30))
def test_increments_add_up_and_never_break_a_character(
        tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text)
    replies, _ = stream(tokenizer, ids)
    assert "".join(r.incremental_output for r in replies) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in r.incremental_output for r in replies)
    assert [r.finished for r in replies].count(True) == 1 and replies[-1].finished
    assert replies[-1].finish_reason == "length" and replies[-1].completion_tokens == len(ids)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 511), min_size=1, max_size=30))
def test_any_token_stream_adds_up_to_its_decode(tokenizer: PreTrainedTokenizerBase,
                                                ids: list[int]) -> None:
    """Random ids may never complete a character: then the replacement character shows, once,
    where HF's decode puts it too."""
    replies, _ = stream(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(r.incremental_output for r in replies) == full


def test_eos_is_never_shown(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("hi 你好") + [tokenizer.eos_token_id]
    replies, _ = stream(tokenizer, ids, reason="stop")
    assert "".join(r.incremental_output for r in replies) == "hi 你好"
    assert replies[-1].finish_reason == "stop"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(texts(1, 20), texts(1, 4), texts(0, 10))
def test_output_stops_before_the_stop_string(tokenizer: PreTrainedTokenizerBase, head: str,
                                             stop: str, tail: str) -> None:
    ids = tokenizer.encode(head + stop + tail)
    replies, aborts = stream(tokenizer, ids, stop=[stop])
    text = "".join(r.incremental_output for r in replies)
    # up to the first occurrence; a stream cannot take text back, so no character of the stop
    # string was ever sent, not even while it was being spelled out
    assert text == (head + stop + tail)[: (head + stop).find(stop)]
    assert stop not in text and replies[-1].finished and replies[-1].finish_reason == "stop"
    assert sum(aborts) <= 1  # the scheduler is told once, and only if it was still running


def test_stop_string_across_two_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("one two three four")
    pieces = [tokenizer.decode([i]) for i in ids]
    k = next(i for i in range(len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[k][-1] + pieces[k + 1][0]  # last character of one token, first of the next
    replies, aborts = stream(tokenizer, ids, stop=[stop])
    text = "".join(r.incremental_output for r in replies)
    assert text == "".join(pieces)[: "".join(pieces).find(stop)]
    assert any(aborts) and replies[-1].finish_reason == "stop"


# --- the process -------------------------------------------------------------------------------

def test_server_answers_bad_prompts_and_waits_for_setups(
        tokenizer_path: str, tokenizer: PreTrainedTokenizerBase) -> None:
    a, b = tokenizer.encode("A") + tokenizer.encode("B")  # one token each
    server = TokenizerServer(tokenizer_path, forward_setups=False, setups_from_workers=True)
    # as real templates do for, say, roles that do not alternate: not a ValueError
    server.tokenize.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    to_scheduler, replies, setups = server.handle(
        [TokenizeMsg(1, [9999], SamplingParams(), []), DetokenizeMsg(2, a, False),
         TokenizeMsg(3, CHAT, SamplingParams(), [])])
    assert to_scheduler == [] and setups == []
    assert [(r.uid, r.finish_reason, r.finished) for r in replies] == [(1, "error", True),
                                                                        (3, "error", True)]
    assert "roles must alternate" in replies[1].error
    assert server.early[2]  # held: its setup has not come yet
    _, replies, _ = server.handle([DetokenizeSetupMsg(2, 4, []), DetokenizeMsg(2, b, True)])
    assert [(r.incremental_output, r.finished) for r in replies] == [("A", False), ("B", True)]
    assert replies[-1].prompt_tokens == 4 and replies[-1].completion_tokens == 2
    assert not server.early


def test_a_lone_process_drops_tokens_no_request_claims(tokenizer_path: str) -> None:
    """Without workers every setup is made in the same handle() call as its request, so a
    token for an unknown uid is a stray (its request was answered): kept, it would leak."""
    server = TokenizerServer(tokenizer_path, forward_setups=False)
    assert server.handle([DetokenizeMsg(7, 5, False)]) == ([], [], [])
    assert not server.early


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_chat_in_text_out_equals_hf(arch: str, model_dir: Callable[[str], Path],
                                    make_llm: Callable) -> None:
    """The whole path but the sockets, for every architecture the server can load: the chat
    is templated, the engine gives HF's greedy tokens for it, and the text streamed out token
    by token equals HF's tokens decoded at once."""
    path = model_dir(arch)
    server = TokenizerServer(str(path), forward_setups=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [user], _, _ = server.handle([TokenizeMsg(1, CHAT, params, [])])
    prompt = user.input_ids.tolist()
    tokens = make_llm(path, cache_type="naive").generate([prompt], params)[0]["token_ids"]
    ref = hf_greedy(path, prompt, 12)[0]
    assert tokens == ref
    _, replies, _ = server.handle([DetokenizeMsg(1, t, i == 11, "length" if i == 11 else None)
                                   for i, t in enumerate(tokens)])
    text = server.detokenize.tokenizer.decode(ref, skip_special_tokens=True)
    assert "".join(r.incremental_output for r in replies) == text
    assert replies[-1].finish_reason == "length" and replies[-1].prompt_tokens == len(prompt)


@pytest.fixture(scope="module")
def tokenizer_path(model_dir: Callable[[str], Path]) -> str:
    return str(model_dir("tiny-qwen3"))


@pytest.mark.parametrize("workers", [0, 1])
def test_tokenizer_process_serves_real_sockets(
        tokenizer_path: str, tokenizer: PreTrainedTokenizerBase, workers: int) -> None:
    """--num-tokenizer 0: one process does both; 1: a worker tokenizes, another detokenizes."""
    ns = IpcNamespace()
    ctx = mp.get_context("spawn")
    procs = []
    try:
        with ZmqPullQueue(ns.addr("backend"), bind=True, expected=BatchBackendMsg) as backend, \
                ZmqPullQueue(ns.addr("frontend"), bind=True, expected=BatchFrontendMsg) as front, \
                ZmqPushQueue(ns.addr("tokenizer"), bind=workers > 0) as to_tokenizer, \
                ZmqPushQueue(ns.addr("detokenizer"), bind=False) as scheduler_out:
            common = dict(model_path=tokenizer_path, backend=ns.addr("backend"),
                          frontend=ns.addr("frontend"))
            procs.append(ctx.Process(target=tokenizer_worker, kwargs=dict(
                common, inbox=ns.addr("detokenizer"), bind_inbox=True, has_workers=workers > 0)))
            if workers:
                procs.append(ctx.Process(target=tokenizer_worker, kwargs=dict(
                    common, inbox=ns.addr("tokenizer"), bind_inbox=False,
                    detokenizer=ns.addr("detokenizer"))))
            to_api = to_tokenizer if workers else scheduler_out  # where the API server sends
            for p in procs:
                p.start()
            to_api.put(BatchTokenizerMsg([TokenizeMsg(5, CHAT, SamplingParams(max_tokens=9),
                                                      ["STOP"]), AbortMsg(6)]))
            got = backend.get(timeout_ms=60_000)
            assert got is not None
            user, abort = got.data
            assert isinstance(user, UserMsg) and user.uid == 5 and abort == AbortBackendMsg(6)
            assert user.input_ids.tolist() == TokenizeManager(tokenizer).tokenize(
                TokenizeMsg(5, CHAT, SamplingParams(), [])).tolist()
            ids = tokenizer.encode("你好 STOP no")
            for i, t in enumerate(ids):
                scheduler_out.put(DetokenizeMsg(5, t, i == len(ids) - 1,
                                                "length" if i == len(ids) - 1 else None))
            replies: list[UserReply] = []
            while not (replies and replies[-1].finished):
                batch = front.get(timeout_ms=60_000)
                assert batch is not None
                replies += batch.data
            assert "".join(r.incremental_output for r in replies) == "你好 "
            assert replies[-1].finish_reason == "stop"
            assert replies[-1].prompt_tokens == len(user.input_ids)
            aborted = backend.get(timeout_ms=60_000)  # the stop string aborts it in the scheduler
            assert aborted is not None and aborted.data == [AbortBackendMsg(5)]
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=10)
        ns.remove()
    assert all(p.exitcode == 0 for p in procs)  # SIGTERM: a clean exit, sockets closed
