"""Chapter 21: the draw without a sort. With no top-k and no top-p the sampler no longer sorts
the vocabulary; its frequencies still follow the float64 softmax, zero-probability tokens are
never drawn, and a request that cuts by k or p still takes chapter 6's sorted path."""

from __future__ import annotations

import pytest
import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine import sample
from minisgl.engine.sample import Sampler


def _batch(params: list[SamplingParams]) -> Batch:
    reqs = [Req(torch.tensor([1], dtype=torch.int32), i, 0, 4, i, p)
            for i, p in enumerate(params)]
    return Batch(reqs, "decode")


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    n = float(counts.sum())
    chi2 = float(((counts - expected * n) ** 2 / (expected * n)).sum())
    dof = torch.tensor((expected.numel() - 1) / 2)
    return float(torch.special.gammaincc(dof, torch.tensor(chi2 / 2)))


def test_frequencies_follow_the_float64_softmax() -> None:
    logits = torch.tensor([2.0, 1.6, 1.1, 0.9, 0.3, -0.2, -1.0, -3.0])
    expected = torch.softmax(logits.double() / 0.7, dim=-1)  # written here, in float64
    sampler = Sampler(torch.device("cpu"), vocab_size=8, seed=11)
    args = sampler.prepare(_batch([SamplingParams(temperature=0.7)] * 4000))
    assert args.top_k is None and args.top_p is None
    counts = sum(torch.bincount(sampler.sample(logits.expand(4000, 8), args), minlength=8)
                 for _ in range(25)).double()
    assert _p_value(counts, expected) > 1e-3


def test_no_sort_without_a_cut_and_the_sorted_path_with_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    sorted_draw = sample.sample_from_probs
    monkeypatch.setattr(sample, "sample_from_probs",
                        lambda *a: calls.append("sorted") or sorted_draw(*a))
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("sorted the vocab"))
    sampler = Sampler(torch.device("cpu"), vocab_size=50, seed=0)
    logits = torch.randn(3, 50)
    plain = [SamplingParams(temperature=0.6), SamplingParams(), SamplingParams(temperature=1.2)]
    sampler.sample(logits, sampler.prepare(_batch(plain)))
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setattr(sample, "sample_from_probs",
                        lambda *a: calls.append("sorted") or sorted_draw(*a))
    cut = [*plain[:2], SamplingParams(temperature=1.0, top_k=5)]
    sampler.sample(logits, sampler.prepare(_batch(cut)))
    assert calls == ["sorted"]


def test_zero_probability_is_never_drawn_and_greedy_rows_stay_greedy() -> None:
    """A token whose probability underflows to 0 is never drawn; a greedy request in a sampled
    batch (temperature 1e-6) picks its argmax every time."""
    logits = torch.tensor([[0.0, -200.0, 1.0, -200.0], [3.0, 2.9, -1.0, 0.5]])
    sampler = Sampler(torch.device("cpu"), vocab_size=4, seed=3)
    args = sampler.prepare(_batch([SamplingParams(temperature=1.0), SamplingParams()]))
    for _ in range(500):
        picks = sampler.sample(logits, args).tolist()
        assert picks[0] in (0, 2) and picks[1] == 0


def test_a_noise_draw_of_zero_cannot_pick_an_impossible_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Exp(1) may return exactly 0 (rarely; a batch of 256 rows over 151,936 tokens draws 39M a
    step): 0 / 0 is nan, and argmax takes nan for the largest. The noise is clamped above 0."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, **kw: self.zero_())
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7], [0.0, 0.0, 1.0, 0.0]])
    picks = sample.sample_without_cut(probs, torch.Generator()).tolist()
    assert probs[0, picks[0]] > 0 and picks[1] == 2
