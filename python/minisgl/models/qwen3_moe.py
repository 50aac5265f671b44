"""Qwen3-MoE: Qwen3's attention, and a router with experts in place of the MLP (chapter 20)."""

from __future__ import annotations

import torch

from minisgl.layers import BaseOP, LinearReplicated
from minisgl.layers.moe import MoELayer

from minisgl.model_config import ModelConfig
from .utils import CausalLM


class SparseMoeBlock(BaseOP):
    """The router (`gate`, every rank holds all of it) scores the experts; MoELayer picks the
    top k and runs them."""

    def __init__(self, config: ModelConfig) -> None:
        self.gate = LinearReplicated(config.hidden_size, config.num_experts, has_bias=False)
        self.experts = MoELayer(num_experts=config.num_experts,
                                top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
                                intermediate_size=config.moe_intermediate_size,
                                renormalize=config.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.forward(x, self.gate.forward(x))


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm = True

    def make_mlp(self, config: ModelConfig, layer_id: int) -> BaseOP:
        """Experts where HF puts them (decoder_sparse_step, mlp_only_layers); else the MLP."""
        if config.is_moe_layer(layer_id):
            return SparseMoeBlock(config)
        return super().make_mlp(config, layer_id)
