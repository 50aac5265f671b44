"""MoE backends by name: `torch` (a loop over experts) and `triton` (fused, chapter 20)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from minisgl.utils.registry import Registry

from .base import BaseMoeBackend, select_experts

logger = logging.getLogger(__name__)
MOE_BACKENDS: Registry[Callable[[torch.device], BaseMoeBackend]] = Registry("MoE backend")


@MOE_BACKENDS.register("torch")
def _create_torch(device: torch.device) -> BaseMoeBackend:
    from .torch_backend import TorchMoeBackend

    return TorchMoeBackend()


@MOE_BACKENDS.register("triton")
def _create_triton(device: torch.device) -> BaseMoeBackend:
    from .triton_backend import TritonMoeBackend

    return TritonMoeBackend(device)


def resolve_moe_backend(name: str, device: torch.device) -> str:
    """`auto`: triton on a GPU where Triton is installed, else torch, said in one log line. Any
    other name is checked here, so a typo fails before the weights load."""
    if name != "auto":
        MOE_BACKENDS[name]  # noqa: B018 (raises KeyError naming the choices)
        return name
    if device.type != "cuda":
        name, why = "torch", f"no GPU kernels on {device.type}"
    elif importlib.util.find_spec("triton") is None:
        name, why = "torch", "triton is not installed: pip install triton"
    else:
        name, why = "triton", "a GPU with Triton"
    logger.info("MoE: --moe-backend auto -> %s (%s)", name, why)
    return name


def create_moe_backend(name: str, device: torch.device) -> BaseMoeBackend:
    return MOE_BACKENDS[name](device)


__all__ = ["MOE_BACKENDS", "BaseMoeBackend", "create_moe_backend", "resolve_moe_backend",
           "select_experts"]
