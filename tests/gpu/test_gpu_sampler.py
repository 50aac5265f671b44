"""The draws of chapters 6 and 21 on the GPU: 400,000 draws from 8 tokens at temperature 0.8,
their frequencies against the float64 softmax by a chi-square test. Chapter 6's sorted draw,
the draw without a sort (sample_without_cut), our one-pass kernel (cuda.sample) and the
selection of the k best (sample_top_k, here with k = all 8); their times are
`benchmark/gpu_bench.py sampler`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]

ROWS, ROUNDS = 100_000, 4  # 4 draws of one token for each of 100,000 rows
EXPECTED = torch.softmax(torch.tensor([2.0, 1.6, 1.1, 0.9, 0.3, -0.2, -1.0, -3.0],
                                      dtype=torch.float64) / 0.8, dim=-1)


def draws() -> dict[str, Callable[[int], torch.Tensor]]:
    """name -> draw(i), round i's token for each row, from EXPECTED (probabilities, or logits
    and temperatures for the kernel)."""
    from minisgl.engine.sample import sample_from_probs, sample_top_k, sample_without_cut
    from minisgl.kernel import cuda

    g = torch.Generator("cuda").manual_seed(0)
    probs = EXPECTED.float().cuda().expand(ROWS, 8).contiguous()
    logits = (EXPECTED.log() * 0.8).float().cuda().expand(ROWS, 8).contiguous()
    temps = torch.full((ROWS,), 0.8, device="cuda")
    return {"sorted draw (sample_from_probs)": lambda i: sample_from_probs(probs, None, None, g),
            "sampler without a sort": lambda i: sample_without_cut(probs, g),
            "our sampling kernel": lambda i: cuda.sample(logits, temps, 7, i).long(),
            "selection of the k best (sample_top_k)": lambda i: sample_top_k(
                logits, temps, torch.full((ROWS,), 8, device="cuda"), 8, None, g)}


@pytest.mark.parametrize("name", ["sorted draw (sample_from_probs)", "sampler without a sort",
                                  "our sampling kernel", "selection of the k best (sample_top_k)"])
def test_draw_frequencies_match_the_softmax(name: str) -> None:
    """Chi-square with 7 degrees of freedom; fails below p = 1e-3 (one run in a thousand of a
    right sampler would; the seeds are fixed, so a run is repeatable)."""
    draw = draws()[name]
    counts = torch.stack([torch.bincount(draw(i), minlength=8) for i in range(ROUNDS)]
                         ).sum(0).double().cpu()
    exp = EXPECTED * ROWS * ROUNDS
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(3.5), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (f"{name}: {ROWS * ROUNDS:,} draws from 8 tokens, chi-square "
                            f"{chi2:.1f} with 7 degrees of freedom, p = {p_value:.3g}; counts "
                            f"{counts.tolist()}, expected {[round(e) for e in exp.tolist()]}")
