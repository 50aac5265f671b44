"""Attention backends by name: `torch` here; GPU backends join in chapter 17 (chapter 5)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.models import ModelConfig
from minisgl.utils.registry import Registry

from .base import BaseAttnBackend, BaseAttnMetadata

BACKENDS: Registry[Callable[[ModelConfig], BaseAttnBackend]] = Registry("attention backend")


@BACKENDS.register("torch")
def _create_torch(config: ModelConfig) -> BaseAttnBackend:
    from .torch_backend import TorchBackend

    return TorchBackend(config)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` picks the best backend for the device: only `torch` exists so far."""
    return "torch" if name == "auto" else name


def create_attention_backend(name: str, config: ModelConfig) -> BaseAttnBackend:
    return BACKENDS[name](config)


__all__ = ["BACKENDS", "BaseAttnBackend", "BaseAttnMetadata", "create_attention_backend",
           "resolve_backend_name"]
