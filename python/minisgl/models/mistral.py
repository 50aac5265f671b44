"""Mistral: the same blocks as Llama; sliding-window attention is not supported (chapter 3)."""

from .utils import CausalLM


class MistralForCausalLM(CausalLM):
    """A checkpoint with a sliding window is refused by ModelConfig.from_hf."""
