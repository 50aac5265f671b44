"""The model registry: architectures[0] of config.json -> model class (chapter 3)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .base import BaseLLMModel
from minisgl.model_config import ModelConfig

# architecture name -> module under minisgl.models; imported only when asked for
_MODELS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def get_model_class(architecture: str) -> Callable[[ModelConfig], BaseLLMModel]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(_MODELS))}")
    module = importlib.import_module(f"minisgl.models.{_MODELS[architecture]}")
    return getattr(module, architecture)


def create_model(config: ModelConfig) -> BaseLLMModel:
    """Build the model; call it under `with torch.device("meta")` to allocate nothing."""
    return get_model_class(config.architecture)(config)
