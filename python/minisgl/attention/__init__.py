"""Attention backends by name (chapter 5): `torch`, `fi`, `fa` and PREFILL,DECODE pairs."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from minisgl.model_config import ModelConfig
from minisgl.utils.registry import Registry

from .base import BaseAttnBackend, BaseAttnMetadata

logger = logging.getLogger(__name__)
BACKENDS: Registry[Callable[[ModelConfig], BaseAttnBackend]] = Registry("attention backend")


@BACKENDS.register("torch")
def _create_torch(config: ModelConfig) -> BaseAttnBackend:
    from .torch_backend import TorchBackend

    return TorchBackend(config)


@BACKENDS.register("fi")
def _create_flashinfer(config: ModelConfig) -> BaseAttnBackend:
    from .fi import FlashInferBackend

    return FlashInferBackend(config)


@BACKENDS.register("fa")
def _create_flash_attention(config: ModelConfig) -> BaseAttnBackend:
    from .fa import FlashAttentionBackend

    return FlashAttentionBackend(config)


GPU_ONLY = ("fi", "fa")  # FlashInfer and FlashAttention: half-precision kernels only
# FlashInfer's prefill kernel takes no head_dim below 64 (KernelTraits::IsInvalid in its
# attention/prefill.cuh: fewer than 4 MMA tiles of 16 along the head fail at the first prefill)
FI_MIN_HEAD_DIM = 64


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype | None = None,
                         head_dim: int | None = None) -> str:
    """`auto` picks by GPU generation, by what is installed and by the model's dtype and head
    size, and says so in one log line: Hopper (sm90) with sgl-kernel and FlashInfer -> `fa,fi`;
    a GPU with FlashInfer -> `fi`; the CPU, a GPU without FlashInfer, a float32 model or a
    head_dim below 64 -> `torch`. Any other name is checked here, when the engine starts: a typo
    fails with the list of names, a GPU backend asked to run a float32 model on a GPU, or `fi`
    to prefill heads below 64 there, with the remedy (on the CPU, the fakes that stand in for
    them compute in float32 at any head size)."""
    if name == "auto":
        name, why = _auto(device, dtype, head_dim)
        slow = device.type == "cuda" and name == "torch" and dtype != torch.float32
        logger.log(logging.WARNING if slow else logging.INFO, "attention: --attn auto -> %s (%s)",
                   name, why)
        return name
    parts = name.split(",")
    if len(parts) > 2:
        raise ValueError(f"--attn {name!r}: one backend, or PREFILL,DECODE (two names)")
    for part in parts:
        BACKENDS[part]  # noqa: B018 (raises KeyError naming the choices)
    if device.type == "cuda" and dtype == torch.float32 and any(p in GPU_ONLY for p in parts):
        raise ValueError(f"--attn {name!r}: FlashInfer and FlashAttention have no float32 "
                         "kernels; use --attn torch (or auto) for a float32 model, or load it "
                         "in bfloat16")
    if device.type == "cuda" and head_dim is not None and head_dim < FI_MIN_HEAD_DIM \
            and parts[0] == "fi":
        raise ValueError(f"--attn {name!r}: FlashInfer's prefill has no kernels for head_dim "
                         f"{head_dim} (it needs {FI_MIN_HEAD_DIM} or more); use --attn torch "
                         "(or auto)")
    return name


def _auto(device: torch.device, dtype: torch.dtype | None,
          head_dim: int | None) -> tuple[str, str]:
    if device.type != "cuda":
        return "torch", f"no GPU kernels on {device.type}"
    if dtype == torch.float32:
        return "torch", "float32: FlashInfer and FlashAttention have no float32 kernels"
    if head_dim is not None and head_dim < FI_MIN_HEAD_DIM:
        return "torch", f"head_dim {head_dim}: FlashInfer's prefill needs {FI_MIN_HEAD_DIM} or more"
    if importlib.util.find_spec("flashinfer") is None:
        return "torch", "flashinfer is not installed: pip install flashinfer-python==0.5.3"
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9 and importlib.util.find_spec("sgl_kernel") is not None:
        return "fa,fi", "Hopper: FlashAttention 3 prefill, FlashInfer decode"
    return "fi", f"sm{major}{minor}" + ("" if major != 9 else ", sgl-kernel not installed")


def create_attention_backend(name: str, config: ModelConfig) -> BaseAttnBackend:
    """One backend, or a HybridBackend for `PREFILL,DECODE`."""
    prefill, _, decode = name.partition(",")
    if not decode or decode == prefill:
        return BACKENDS[prefill](config)
    from .hybrid import HybridBackend

    return HybridBackend(BACKENDS[prefill](config), BACKENDS[decode](config))


__all__ = ["BACKENDS", "BaseAttnBackend", "BaseAttnMetadata", "create_attention_backend",
           "resolve_backend_name"]
