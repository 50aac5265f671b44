"""Qwen2: the Llama blocks with biases on q, k and v (chapter 3)."""

from .utils import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
