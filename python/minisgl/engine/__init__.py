"""The engine: model + KV pool + attention backend + sampler in one object (chapter 6)."""

from .config import EngineConfig
from .engine import Engine, ForwardOutput
from .sample import BatchSamplingArgs, Sampler

__all__ = ["BatchSamplingArgs", "Engine", "EngineConfig", "ForwardOutput", "Sampler"]
