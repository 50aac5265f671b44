"""Chapter 21: the scheduler's host work per step, made cheap without changing what it does. A
request's tokens grow in a buffer (one store per token), and the deferral rule of chapter 9
compares a waiting prompt only with the batch's requests that begin as it does."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.scheduler import prefill


def test_appended_tokens_outgrow_the_first_buffer() -> None:
    """Past the first buffer (prompt + 256) the buffer doubles; input_ids stays the prompt and
    every token appended, in order, as int32 on the CPU, and a view taken earlier keeps its
    length and values."""
    req = Req(torch.arange(5, dtype=torch.int32), 0, 0, 1000, 0, SamplingParams())
    early = req.input_ids
    tokens = [(7 * i) % 101 for i in range(700)]
    for t in tokens:
        req.complete_one()
        req.append_host(t)
    assert req.input_ids.tolist() == list(range(5)) + tokens
    assert req.input_ids.dtype == torch.int32 and req.host_len == 705
    assert early.tolist() == list(range(5))


def test_deferral_compares_only_prompts_that_begin_alike(
        make_llm: Callable, model_dir: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """48 unrelated prompts and 4 behind one 40-token prefix, admitted in one prefill: the
    deferral rule compares each of the 4 only with those already in the batch that share the
    prefix (at most 0 + 1 + 2 + 3 = 6 comparisons, not some 1,300 for all pairs), and it still
    defers them: the first computes the prefix, the other 3 find it in the cache."""
    calls = []
    real = prefill.match_len

    def counted(a: torch.Tensor, b: torch.Tensor) -> int:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(prefill, "match_len", counted)
    llm = make_llm(model_dir("tiny-qwen3"), overlap=False, cache_type="radix",
                   num_page_override=8192)
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(48)]
    prompts += [shared + [rng.randrange(3, 500) for _ in range(8)] for _ in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert 0 < len(calls) <= 6
    assert llm.stats.cached_tokens >= 3 * 40


def test_host_lists_reach_the_device_without_a_blocking_copy(
        make_llm: Callable, model_dir: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy from pageable host memory to a GPU synchronizes the stream: with overlap the host
    would wait for the batch in flight. So every host list the loop sends to the device (the
    sampler's temperatures, the LM head's last-token indices, the scheduler's indices) goes
    through a pinned, non-blocking copy. On the CPU the copies are no-ops, but the calls that
    would make them are the same: none may ask for a blocking copy to a device, and none may
    build a tensor on a device from a Python list."""
    llm = make_llm(model_dir("tiny-qwen3"), overlap=True)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 23, 40)]
    sampled = SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, sampled)  # first use: one-time moves (the RoPE table) happen here
    blocking: list[str] = []
    real_to, real_tensor = torch.Tensor.to, torch.tensor

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        device = next((a for a in args if isinstance(a, torch.device)), kwargs.get("device"))
        if isinstance(device, torch.device) and not kwargs.get("non_blocking", False):
            blocking.append(f"Tensor.to({device})")
        return real_to(self, *args, **kwargs)

    def tensor(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("device") is not None:
            blocking.append(f"torch.tensor(device={kwargs['device']})")
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "tensor", tensor)
    llm.generate([[rng.randrange(3, 500) for _ in range(n)] for n in (12, 30)], sampled)
    monkeypatch.undo()
    assert blocking == []
