"""Qwen3: an RMSNorm on every head of q and k, before RoPE (chapter 3)."""

from .utils import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
