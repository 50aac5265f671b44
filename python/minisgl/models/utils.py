"""The decoder blocks the models share: gated MLP, attention block, layer (chapter 3); an MoE
model brings its own feed-forward block through CausalLM.make_mlp."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.core import get_global_ctx
from minisgl.layers import (
    BaseOP,
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearRowParallel,
    OPList,
    ParallelLMHead,
    RMSNorm,
    RMSNormFused,
    RotaryEmbedding,
    VocabParallelEmbedding,
    silu_and_mul,
)
from minisgl.layers.attention import AttentionLayer

from .base import BaseLLMModel
from minisgl.model_config import ModelConfig


class GatedMLP(BaseOP):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        inter = config.intermediate_size
        self.gate_up_proj = LinearColParallelMerged(config.hidden_size, [inter, inter])
        self.down_proj = LinearRowParallel(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class RopeAttn(BaseOP):
    """qkv_proj -> (q/k norm) -> RoPE -> attention -> o_proj."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 qk_norm: bool, qkv_bias: bool) -> None:
        c = config
        self.qkv_proj = LinearQKVMerged(c.hidden_size, c.head_dim, c.num_qo_heads,
                                        c.num_kv_heads, has_bias=qkv_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if qk_norm else None
        self.attn = AttentionLayer(layer_id, num_qo_heads=c.num_qo_heads,
                                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                   rotary=rotary, q_norm=self.q_norm, k_norm=self.k_norm)
        self.o_proj = LinearOProj(c.num_qo_heads * c.head_dim, c.hidden_size,
                                  has_bias=c.attention_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj.forward(self.attn.forward(self.qkv_proj.forward(x)))


class DecoderLayer(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 qk_norm: bool, qkv_bias: bool, mlp: BaseOP) -> None:
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNormFused(config.hidden_size, eps)
        self.self_attn = RopeAttn(config, layer_id, rotary=rotary, qk_norm=qk_norm,
                                  qkv_bias=qkv_bias)
        self.post_attention_layernorm = RMSNormFused(config.hidden_size, eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class DecoderModel(BaseOP):
    def __init__(self, config: ModelConfig, qk_norm: bool, qkv_bias: bool,
                 make_mlp: Callable[[ModelConfig, int], BaseOP]) -> None:
        rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = OPList([DecoderLayer(config, i, rotary=rotary, qk_norm=qk_norm,
                                           qkv_bias=qkv_bias, mlp=make_mlp(config, i))
                              for i in range(config.num_layers)])
        self.norm = RMSNormFused(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens.forward(input_ids), None
        for layer in self.layers.op_list:
            x, residual = layer.forward(x, residual)
        return self.norm.forward(x, residual)[0]


class CausalLM(BaseLLMModel):
    """The HF layout `model.*` + `lm_head`; subclasses say which variant they are."""

    qk_norm = False  # Qwen3 normalises q and k per head
    qkv_bias = False  # Qwen2 has biases on q, k and v

    def __init__(self, config: ModelConfig) -> None:
        self.model = DecoderModel(config, self.qk_norm, self.qkv_bias or config.attention_bias,
                                  self.make_mlp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied)

    def make_mlp(self, config: ModelConfig, layer_id: int) -> BaseOP:
        """Layer `layer_id`'s feed-forward block: the gated MLP here; experts in an MoE model."""
        return GatedMLP(config)

    def forward(self) -> torch.Tensor:
        return self.lm_head.forward(self.model.forward(get_global_ctx().batch.input_ids))
