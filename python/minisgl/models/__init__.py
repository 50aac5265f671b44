"""Models: config, registry, the dense architectures and weight loading (chapter 3)."""

from .base import BaseLLMModel
from minisgl.model_config import ModelConfig, load_hf_config
from .register import create_model, get_model_class
from .weight import load_weight

__all__ = [
    "BaseLLMModel",
    "ModelConfig",
    "create_model",
    "get_model_class",
    "load_hf_config",
    "load_weight",
]
