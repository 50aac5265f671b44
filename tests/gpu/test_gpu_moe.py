"""Chapter 20: the Triton fused MoE against the torch backend (a loop over experts) on one random
layer, then a Qwen3-MoE model generating with each. On CUDA the compiled kernel, on a
Qwen3-30B-A3B layer (these tests are marked gpu); without CUDA the same checks, tiny, with the
kernel run by Triton's interpreter (not marked gpu: the one part of tests/gpu that runs on a
CPU, a few seconds; with CUDA it skips, as the interpreter must not take the kernel over there).
So the marks are per test here, not for the module. The layer's times are
`benchmark/gpu_bench.py moe`.

TRITON_INTERPRET is read when minisgl/kernel/fused_moe.py is first imported; pytest imports this
module while it collects, before any test runs, so setting it here reaches that import (as
tests/ch20/conftest.py does for chapter 20's tests)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_common import (
    BF16_TOL,
    MOE_LIMITS,
    MOE_SHAPE,
    MOE_TINY,
    moe_generate,
    moe_layer_error,
    relative_errors,
)

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA (none on this machine)")
without_cuda = pytest.mark.skipif(CUDA, reason="CUDA is here: the compiled kernel is tested")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the dev and gpu extras)")
ON_GPU = [pytest.mark.gpu, needs_cuda, needs_triton]
INTERPRETED = [without_cuda, needs_triton]
LAYERS = ([pytest.param("cuda", n, marks=ON_GPU, id=f"cuda-{n}") for n in (1, 8, 64, 256, 1024)]
          + [pytest.param("cpu", n, marks=INTERPRETED, id=f"cpu-{n}") for n in (1, 8, 64)])


@cache
def backends(device: str) -> dict[str, Any]:
    """Both MoE backends on `device`; on the CPU the kernel must be interpreted."""
    from minisgl.kernel import fused_moe
    from minisgl.moe import create_moe_backend

    if device == "cpu":
        assert fused_moe.INTERPRETED, "the Triton kernel is compiled, not interpreted"
    return {name: create_moe_backend(name, torch.device(device)) for name in ("torch", "triton")}


@pytest.mark.parametrize("device,tokens", LAYERS)
@pytest.mark.parametrize("dtype,limit", MOE_LIMITS, ids=["bfloat16", "float32"])
def test_triton_layer_equals_torch(dtype: torch.dtype, limit: float, device: str,
                                   tokens: int) -> None:
    """Random weights scaled like a trained layer's; on CUDA hidden 2048, 128 experts, top 8,
    moe_intermediate 768; on the CPU tiny-qwen3-moe's 64, 8, 2 and 32."""
    shape = MOE_SHAPE if device == "cuda" else MOE_TINY
    err = moe_layer_error(backends(device), shape, tokens, dtype, device)
    assert err <= limit, (f"triton vs torch on {device}, {str(dtype)[6:]}, {tokens} tokens: "
                          f"relative error {err:.1e} (limit {limit:g})")


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_triton_generate_within_torch_bf16_error(moe_model: Path) -> None:
    """$MINISGL_MOE (or tiny-qwen3-moe) generating with the torch backend in float32 (the
    reference: a bfloat16 run against a bfloat16 run compounds two errors), then torch and
    triton in bfloat16; logits compared while the tokens agree. bfloat16 alone costs the torch
    backend's own error over a few random layers: that is the bar, and triton may round
    differently, not worse: within 25% of it, or within BF16_TOL."""
    ref, ref_logits = moe_generate(moe_model, "cuda", "torch", torch.float32)
    base_tokens, base_logits = moe_generate(moe_model, "cuda", "torch", torch.bfloat16)
    got, logits = moe_generate(moe_model, "cuda", "triton", torch.bfloat16)
    baseline = relative_errors(base_tokens, ref, base_logits, ref_logits)
    errs = relative_errors(got, ref, logits, ref_logits)
    assert baseline and errs, f"steps compared: torch bf16 {len(baseline)}, triton {len(errs)}"
    limit = max(BF16_TOL, 1.25 * max(baseline))
    same = sum(a == b for a, b in zip(got, ref))
    assert max(errs) <= limit, (
        f"{moe_model.name}: triton bf16 vs torch float32: relative logits error max "
        f"{max(errs):.1e} over {len(errs)} steps (limit {limit:g}: torch bf16's own is "
        f"{max(baseline):.1e}); {same}/{len(ref)} requests give all 24 tokens alike")


@without_cuda
@needs_triton
def test_interpreted_triton_generate_equals_torch(tiny: Callable[[str], Path]) -> None:
    """tiny-qwen3-moe on the CPU generating with each backend in float32: every request's 24
    greedy tokens alike, and the logits within 1e-5 relative while the tokens agree."""
    backends("cpu")  # the kernel is interpreted
    path = tiny("tiny-qwen3-moe")
    ref, ref_logits = moe_generate(path, "cpu", "torch", torch.float32)
    got, logits = moe_generate(path, "cpu", "triton", torch.float32)
    differ = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    assert not differ, f"requests {differ} of {len(ref)} differ from the torch backend's tokens"
    errs = relative_errors(got, ref, logits, ref_logits)
    assert errs, "no step compared"
    assert max(errs) <= 1e-5, (f"relative logits error max {max(errs):.1e} over {len(errs)} "
                               "steps (limit 1e-05)")
