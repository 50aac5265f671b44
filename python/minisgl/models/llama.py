"""Llama, and SmolLM2 which shares its architecture: the plain dense decoder (chapter 3)."""

from .utils import CausalLM


class LlamaForCausalLM(CausalLM):
    """No q/k norm; biases only if config.json says attention_bias."""
