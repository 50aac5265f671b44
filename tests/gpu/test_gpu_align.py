"""Chapters 6 and 11 on CUDA against HF, float32, the torch backend, on the four tiny models:
chapter 6's Engine with batches filled by hand (stage 1), then the stage-2 LLM with overlap on
and off, radix and naive caches (align). HF's greedy reference runs on the CPU
(tests/reference.py), as in every chapter's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gpu_common import MODELS, PROMPTS, cuda_llm, shared_prefix_prompts, spy_logits

from minisgl.core import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]


@pytest.mark.parametrize("name", MODELS)
def test_stage1_engine_equals_hf(name: str, tiny: Callable[[str], Path],
                                 hand_batcher: type) -> None:
    """Four requests of 5, 3, 32 and 2 tokens in one batch, 16 tokens each, page size 4: the
    same tokens as HF and every step's logits within LOGIT_TOL of HF's."""
    from minisgl.engine import Engine, EngineConfig

    from helpers import hf_reference
    from reference import LOGIT_TOL

    path = tiny(name)
    engine = Engine(EngineConfig(str(path), dtype=torch.float32, num_page_override=256,
                                 max_running_req=8, page_size=4, attention_backend="torch"))
    try:
        assert engine.device.type == "cuda", engine.device
        seen = spy_logits(engine)
        ours = hand_batcher(engine).generate(PROMPTS, SamplingParams(max_tokens=16,
                                                                     ignore_eos=True))
    finally:
        engine.shutdown()
    problems = []
    for i, (ids, tokens) in enumerate(zip(PROMPTS, ours)):
        ref, ref_logits = hf_reference(path, tuple(ids))
        worst = max(float((s[i].cpu() - r).abs().max()) for s, r in zip(seen, ref_logits))
        if tokens != ref or worst > LOGIT_TOL:
            problems.append(f"request {i} ({len(ids)} tokens): same 16 tokens as HF "
                            f"{tokens == ref} (ours {tokens}, HF {ref}), max |dlogit| "
                            f"{worst:.1e} (limit {LOGIT_TOL:g})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("cache_type,max_running_req", [("radix", 16), ("naive", 2)])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap-on", "overlap-off"])
@pytest.mark.parametrize("name", MODELS)
def test_llm_equals_hf(name: str, overlap: bool, cache_type: str, max_running_req: int,
                       tiny: Callable[[str], Path]) -> None:
    """8 requests with a 64-token shared prefix, 12 tokens each, page size 4: HF's tokens."""
    from helpers import hf_reference

    path = tiny(name)
    prompts = shared_prefix_prompts(8, 64, seed=0)
    with cuda_llm(path, overlap, dtype=torch.float32, cache_type=cache_type, page_size=4,
                  max_running_req=max_running_req, num_page_override=512) as llm:
        out = [o["token_ids"] for o in llm.generate(
            prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
        computed = llm.stats.prefill_tokens
    # greedy: HF's first 12 of 16 tokens are what it generates when asked for 12
    refs = [hf_reference(path, tuple(p))[0][:12] for p in prompts]
    differ = [f"request {i}: ours {o}, HF {r}" for i, (o, r) in enumerate(zip(out, refs))
              if o != r]
    assert not differ, (f"{8 - len(differ)}/8 equal HF ({computed} prompt tokens computed):\n"
                        + "\n".join(differ))
