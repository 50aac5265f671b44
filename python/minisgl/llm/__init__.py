"""The offline LLM: `LLM(model_path).generate(prompts, sampling_params)` (chapter 7)."""

from .llm import LLM

__all__ = ["LLM"]
