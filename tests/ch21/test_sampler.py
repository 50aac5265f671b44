"""Chapter 21: the draw without a sort. With no top-k and no top-p the sampler no longer sorts
the vocabulary; its frequencies still follow the float64 softmax, zero-probability tokens are
never drawn. A batch that cuts by k selects each row's k best instead of sorting (frequencies
against chapter 6's rule in float64); only a cut by p alone takes chapter 6's sorted path."""

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
    by_k = [*plain[:2], SamplingParams(temperature=1.0, top_k=5, top_p=0.9)]
    sampler.sample(logits, sampler.prepare(_batch(by_k)))  # a selection of 5, not a sort
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setattr(sample, "sample_from_probs",
                        lambda *a: calls.append("sorted") or sorted_draw(*a))
    by_p = [*plain[:2], SamplingParams(temperature=1.0, top_p=0.9)]
    sampler.sample(logits, sampler.prepare(_batch(by_p)))
    assert calls == ["sorted"]


def _rule64(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Chapter 6's rule in float64, over the whole vocabulary: sort, keep the k best,
    renormalise, keep the tokens whose strictly-more-likely mass is below p."""
    probs, order = torch.softmax(logits.double() / p.temperature, dim=-1).sort(descending=True)
    if p.top_k >= 1:
        probs[p.top_k:] = 0.0
    probs = probs / probs.sum()
    probs[(probs.cumsum(0) - probs) >= p.top_p] = 0.0
    return torch.zeros_like(probs).scatter(0, order, probs / probs.sum())


def test_top_k_frequencies_follow_chapter_6s_rule() -> None:
    """Rows with k = 3, with k = 5 and p = 0.8, and a greedy one, in one batch: the sampler
    selects the 5 best of every row (the largest k of a sampled row); each row's frequencies
    follow chapter 6's rule over the whole vocabulary, the greedy row (whose k is the whole
    vocabulary) takes its argmax every time."""
    logits = torch.tensor([0.3, 2.0, -1.0, 1.6, 1.1, 0.9, -0.2, -3.0])
    rows = [SamplingParams(temperature=0.7, top_k=3),
            SamplingParams(temperature=1.3, top_k=5, top_p=0.8), SamplingParams()]
    n = 2000
    sampler = Sampler(torch.device("cpu"), vocab_size=8, seed=5)
    args = sampler.prepare(_batch([p for p in rows for _ in range(n)]))
    assert args.top_k_max == 5 and args.top_p is not None
    picks = torch.stack([sampler.sample(logits.expand(3 * n, 8), args) for _ in range(25)])
    picks = picks.view(25, 3, n).transpose(0, 1).reshape(3, -1)
    for row, p in zip(picks[:2], rows[:2]):
        expected = _rule64(logits, p)
        counts = torch.bincount(row, minlength=8).double()
        assert counts[expected == 0].sum() == 0, (p, counts)
        kept = expected > 0
        assert _p_value(counts[kept], expected[kept]) > 1e-3, (p, counts)
    assert picks[2].eq(1).all()  # the greedy row's argmax


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
