"""bfloat16 on CUDA (chapter 11's LLM, the torch backend, overlap on): our logits at every step,
teacher-forced on our own tokens, against HF's logits for the same tokens in bfloat16 on the
same GPU, within BF16_TOL relative. HF in float32 gives the scale in the message: our error
against it, and HF bfloat16's own."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gpu_common import BF16_TOL, cuda_llm, hf_on_cuda, shared_prefix_prompts, spy_logits

from minisgl.core import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]


def errors(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """|a - b| / |b| per step, norms over the vocabulary."""
    return [float((a - b).norm() / b.norm()) for a, b in zip(ours, ref)]


def summary(errs: list[float]) -> str:
    return f"max {max(errs):.2e}, median {statistics.median(errs):.2e}"


@pytest.mark.parametrize("name", ["tiny-qwen3", "q06"])
def test_bf16_logits_within_tolerance_of_hf_bf16(name: str,
                                                 model_path: Callable[[str], Path]) -> None:
    """A 40-token prompt (seed 1), 16 tokens: every step's logits against HF's."""
    path = model_path(name)
    ids = shared_prefix_prompts(1, 40, seed=1)[0]
    with cuda_llm(path, True, dtype=torch.bfloat16, num_page_override=256) as llm:
        seen = spy_logits(llm.engine)
        tokens = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0][
            "token_ids"]
    x = torch.tensor([ids + list(tokens[:-1])], device="cuda")
    refs = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = hf_on_cuda(path, dtype)
        with torch.no_grad():
            refs[dtype] = list(hf(x).logits[0, len(ids) - 1:].float())
        del hf
    ours = [s[0] for s in seen]
    errs = errors(ours, refs[torch.bfloat16])
    assert errs, "the sampler saw no logits"
    assert max(errs) <= BF16_TOL, (
        f"ours bf16 vs HF bf16, 16 steps teacher-forced: relative error {summary(errs)} "
        f"(limit {BF16_TOL:g}); for scale, ours bf16 vs HF fp32 "
        f"{summary(errors(ours, refs[torch.float32]))}, HF bf16 vs HF fp32 "
        f"{summary(errors(refs[torch.bfloat16], refs[torch.float32]))}")
