"""Chapter 1: SamplingParams, Req lengths, Batch, the global Context, and the skeleton vs HF."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from minisgl.core import (
    Batch,
    Context,
    Req,
    SamplingParams,
    get_global_ctx,
    set_global_ctx,
)

from conftest import chapter_module
from helpers import global_ctx
from reference import assert_aligned, hf_greedy, hf_tokenizer

PROMPTS = ["The capital of France is", "Hello", "Once upon a time, in a small village by the sea,"]
STEPS = 16


def skeleton() -> ModuleType:
    return chapter_module("ch01_core", "skeleton")


def make_req(n: int = 4, cached: int = 0, output_len: int = 3, uid: int = 0) -> Req:
    ids = torch.arange(10, 10 + n, dtype=torch.int32)
    return Req(ids, uid, cached, output_len, uid, SamplingParams())


@pytest.fixture
def ctx() -> Iterator[Context]:
    """A fresh global Context for one test, always removed again."""
    with global_ctx(page_size=1) as context:
        yield context


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({}, True),  # defaults: temperature 0
        ({"temperature": 0.0, "top_k": 50}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 1}, True),  # only one candidate left: greedy
        ({"temperature": 1.0, "top_k": 5}, False),
        ({"temperature": 0.0, "top_p": 0.9}, False),  # top_p < 1 is a sampling request
        ({"temperature": 0.7, "top_k": 1, "top_p": 0.5}, False),
    ],
)
def test_sampling_params_is_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.1, r">= 0 \(0 means greedy\)"),
        ("temperature", float("nan"), r">= 0 \(0 means greedy\)"),
        ("top_p", 0.0, r"in \(0, 1\]"),
        ("top_p", 1.01, r"in \(0, 1\]"),
        ("top_p", -0.5, r"in \(0, 1\]"),
        ("top_k", 0, r"-1 \(no limit\) or >= 1"),
        ("top_k", -2, r"-1 \(no limit\) or >= 1"),
        ("max_tokens", 0, ">= 1"),
        ("max_tokens", -3, ">= 1"),
    ],
)
def test_sampling_params_rejects_bad_values(field: str, value: float, allowed: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be {allowed}, "
                                         rf"got {value!r}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": -1}, {"top_k": 1},
     {"max_tokens": 1}],
)
def test_sampling_params_accepts_edge_values(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


def test_sampling_params_stays_valid() -> None:
    """Frozen: a checked object cannot be made bad afterwards; replace() checks again."""
    params = SamplingParams(max_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 0  # type: ignore[misc]
    assert dataclasses.replace(params, max_tokens=2).max_tokens == 2
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(params, max_tokens=0)


# ----------------------------------------------------------------------------- Req


def test_req_lengths_at_creation() -> None:
    req = make_req(n=5, cached=2, output_len=4)
    assert req.device_len == 5
    assert req.max_device_len == 9
    assert req.extend_len == 3  # tokens 2, 3, 4 are computed by the next forward pass
    assert req.remain_len == 4
    assert req.can_decode


def test_req_without_output_budget_cannot_decode() -> None:
    req = make_req(n=3, output_len=0)
    assert req.max_device_len == req.device_len == 3
    assert req.remain_len == 0 and not req.can_decode


def test_complete_one_caches_everything_and_reserves_one_slot() -> None:
    req = make_req(n=4, cached=1, output_len=3)
    req.complete_one()
    assert (req.cached_len, req.device_len) == (4, 5)
    assert req.extend_len == 1  # decode: exactly the token about to be sampled
    assert req.remain_len == 2
    req.complete_one()
    req.complete_one()
    assert (req.cached_len, req.device_len, req.remain_len) == (6, 7, 0)
    assert not req.can_decode


@pytest.mark.parametrize("token", [torch.tensor(7), torch.tensor([7]),
                                   torch.tensor(7, dtype=torch.int64)])
def test_append_host_extends_the_cpu_ids(token: torch.Tensor) -> None:
    req = make_req(n=3)
    req.complete_one()
    req.append_host(token)
    assert req.input_ids.tolist() == [10, 11, 12, 7]
    assert req.input_ids.dtype == torch.int32 and req.input_ids.device.type == "cpu"
    assert len(req.input_ids) == req.device_len  # the reserved slot now holds the token


@pytest.mark.parametrize(
    ("n", "cached", "output_len"),
    [
        (4, 4, 3),  # nothing left to compute
        (4, 5, 3),  # more cached than present
        (4, -1, 3),  # negative cache
        (0, 0, 3),  # empty prompt
        (4, 0, -1),  # budget below the prompt
    ],
)
def test_req_rejects_bad_lengths(n: int, cached: int, output_len: int) -> None:
    with pytest.raises(ValueError, match="bad lengths"):
        make_req(n=n, cached=cached, output_len=output_len)


def test_req_rejects_ids_off_the_cpu() -> None:
    ids = torch.zeros(4, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        Req(ids, 0, 0, 3, 0, SamplingParams())


# ----------------------------------------------------------------------------- Batch


def test_batch_properties() -> None:
    reqs = [make_req(uid=0), make_req(n=2, uid=1)]
    prefill, decode = Batch(reqs, "prefill"), Batch(reqs[:1], "decode")
    assert prefill.is_prefill and not prefill.is_decode and prefill.size == 2
    assert decode.is_decode and not decode.is_prefill and decode.size == 1
    prefill.padded_reqs = reqs + [make_req(uid=2), make_req(uid=3)]
    assert prefill.padded_size == 4 and prefill.size == 2


def test_skeleton_make_batch_flattens_new_tokens() -> None:
    reqs = [make_req(n=5, cached=2, uid=0), make_req(n=3, uid=1)]
    batch = skeleton().make_batch(reqs, "prefill")
    assert batch.input_ids.tolist() == [12, 13, 14, 10, 11, 12]
    assert batch.positions.tolist() == [2, 3, 4, 0, 1, 2]
    assert batch.padded_size == batch.size == 2


# ----------------------------------------------------------------------------- Context


def test_forward_batch_scopes_the_batch() -> None:
    ctx = Context(page_size=1)
    batch = Batch([make_req()], "prefill")
    with pytest.raises(RuntimeError, match="forward_batch"):
        _ = ctx.batch
    with ctx.forward_batch(batch):
        assert ctx.batch is batch
    with pytest.raises(RuntimeError, match="forward_batch"):
        _ = ctx.batch


def test_forward_batch_clears_after_an_exception() -> None:
    ctx = Context(page_size=1)
    with pytest.raises(ZeroDivisionError), ctx.forward_batch(Batch([make_req()], "decode")):
        _ = 1 / 0
    with pytest.raises(RuntimeError):
        _ = ctx.batch
    with ctx.forward_batch(Batch([make_req()], "prefill")):  # usable again
        assert ctx.batch.is_prefill


def test_forward_batch_does_not_nest() -> None:
    ctx = Context(page_size=1)
    outer, inner = Batch([make_req()], "prefill"), Batch([make_req()], "decode")
    with ctx.forward_batch(outer):
        with pytest.raises(RuntimeError, match="nest"), ctx.forward_batch(inner):
            pass
        assert ctx.batch is outer  # the refused attempt left the running batch alone
    with pytest.raises(RuntimeError):
        _ = ctx.batch


def test_global_ctx_set_get_and_clear() -> None:
    with pytest.raises(RuntimeError, match="set_global_ctx"):
        get_global_ctx()
    first, second = Context(page_size=1), Context(page_size=16)
    set_global_ctx(first)
    try:
        assert get_global_ctx() is first
        with pytest.raises(RuntimeError, match="already set"):
            set_global_ctx(second)
        assert get_global_ctx() is first  # the refused one did not replace it
    finally:
        set_global_ctx(None)
    with pytest.raises(RuntimeError):
        get_global_ctx()
    set_global_ctx(None)  # clearing twice is harmless
    set_global_ctx(second)
    try:
        assert get_global_ctx() is second and get_global_ctx().page_size == 16
    finally:
        set_global_ctx(None)


# ----------------------------------------------------------------------------- end to end


class Run:
    """What one driven generation leaves behind: tokens and logits per request, and for every
    step the batch together with each request's (cached_len, device_len) when it was made."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.batches: list[Batch] = []
        self.lengths: list[list[tuple[int, int]]] = []


def run_skeleton(path: Path, prompts: list[list[int]]) -> Run:
    """The skeleton's generate() loop, driven here to keep every step's logits and batch."""
    sk = skeleton()
    model, ctx, run = sk.ContextModel(path), get_global_ctx(), Run(len(prompts))
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    reqs = [Req(torch.tensor(p, dtype=torch.int32), i, 0, STEPS, i, params)
            for i, p in enumerate(prompts)]
    for step in range(STEPS):
        batch = sk.make_batch(reqs, "prefill" if step == 0 else "decode")
        run.batches.append(batch)
        run.lengths.append([(r.cached_len, r.device_len) for r in reqs])
        with ctx.forward_batch(batch):
            out = model.forward()
        assert out.shape[0] == len(reqs)  # one row per request, prefill included
        for i, (req, row) in enumerate(zip(reqs, out)):
            run.logits[i].append(row.float())
            run.tokens[i].append(int(row.argmax()))
            req.complete_one()
            req.append_host(row.argmax())
    for req, prompt, tokens in zip(reqs, prompts, run.tokens):
        assert req.input_ids.tolist() == prompt + tokens
    return run


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_skeleton_batch_matches_hf(ctx: Context, model_dir, name: str) -> None:
    path = model_dir(name)
    tok = hf_tokenizer(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts of different lengths"
    run = run_skeleton(path, prompts)
    for prompt, tokens, logits in zip(prompts, run.tokens, run.logits):
        assert_aligned(tokens, logits, *hf_greedy(path, prompt, STEPS))


def test_decode_positions_follow_req_lengths(ctx: Context, model_dir) -> None:
    prompts = [[5, 6, 7, 8, 9], [3, 4], [20, 21, 22]]
    path = model_dir("tiny-qwen3")
    run = run_skeleton(path, prompts)
    # the skeleton's own generate() (fresh model, same batch) gives the same tokens
    assert skeleton().generate(skeleton().ContextModel(path), prompts, STEPS) == run.tokens
    first = run.batches[0]
    assert first.is_prefill
    assert first.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2]
    assert first.input_ids.tolist() == sum(prompts, [])
    assert run.lengths[0] == [(0, 5), (0, 2), (0, 3)]
    for step in range(1, STEPS):
        batch, lengths = run.batches[step], run.lengths[step]
        assert batch.is_decode and batch.size == 3
        # one new token per request, at position cached_len == device_len - 1 ...
        assert all(dev == cached + 1 for cached, dev in lengths)
        assert batch.positions.tolist() == [cached for cached, _ in lengths]
        # ... which is prompt length + step - 1, holding the token sampled one step earlier
        assert batch.positions.tolist() == [len(p) + step - 1 for p in prompts]
        assert batch.input_ids.tolist() == [t[step - 1] for t in run.tokens]


def test_skeleton_refuses_positions_that_skip_the_cache(ctx: Context, model_dir) -> None:
    model = skeleton().ContextModel(model_dir("tiny-qwen3"))
    req = make_req(n=4)
    batch = skeleton().make_batch([req], "prefill")
    batch.positions = batch.positions + 1  # claims token 0 is already cached
    with pytest.raises(RuntimeError, match="first position"), ctx.forward_batch(batch):
        model.forward()
