"""A float32 model on a GPU: `auto` picks the torch backend, and FlashInfer or FlashAttention
asked for by name fails at start with the remedy (their kernels are half precision only; before,
FlashInfer failed mid-forward with a KeyError). Likewise heads below 64 for FlashInfer's prefill
(before, FlashInfer's "Invalid configuration" at the first prefill, seen on an H100)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from minisgl.attention import resolve_backend_name


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return torch.device("cuda")


def test_auto_picks_torch_for_float32(hopper: torch.device,
                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="minisgl.attention"):
        assert resolve_backend_name("auto", hopper, torch.float32) == "torch"
        assert resolve_backend_name("auto", hopper, torch.bfloat16) == "fa,fi"
    first = caplog.records[0]
    assert first.levelname == "INFO" and "float32" in first.message  # a choice, not a warning


@pytest.mark.parametrize("name", ["fi", "fa,fi", "torch,fi", "fa"])
def test_gpu_backends_refuse_float32_with_the_remedy(hopper: torch.device, name: str) -> None:
    with pytest.raises(ValueError, match="no float32 kernels; use --attn torch"):
        resolve_backend_name(name, hopper, torch.float32)
    assert resolve_backend_name(name, hopper, torch.bfloat16) == name
    assert resolve_backend_name("torch", hopper, torch.float32) == "torch"


@pytest.mark.parametrize("head_dim", [16, 32])
def test_small_heads_take_torch_and_fi_prefill_refuses_them(hopper: torch.device,
                                                           head_dim: int) -> None:
    assert resolve_backend_name("auto", hopper, torch.bfloat16, head_dim=head_dim) == "torch"
    assert resolve_backend_name("auto", hopper, torch.bfloat16, head_dim=64) == "fa,fi"
    for name in ("fi", "fi,torch"):
        with pytest.raises(ValueError, match=f"no kernels for head_dim {head_dim} .*--attn torch"):
            resolve_backend_name(name, hopper, torch.bfloat16, head_dim=head_dim)
        assert resolve_backend_name(name, hopper, torch.bfloat16, head_dim=64) == name
    # FlashInfer only decoding, and any name on the CPU (the fakes take any head size): allowed
    assert resolve_backend_name("torch,fi", hopper, torch.bfloat16, head_dim=head_dim) == "torch,fi"
    cpu = torch.device("cpu")
    assert resolve_backend_name("fi", cpu, torch.bfloat16, head_dim=head_dim) == "fi"
