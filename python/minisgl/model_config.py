"""ModelConfig: the few fields of a HF config.json that inference needs (chapter 3)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def load_hf_config(model_path: str | Path) -> dict[str, Any]:
    """config.json of a HF model folder, with a clear error when the folder is not there."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found. Make the book's models with `python tools/models.py tiny` or "
            f"`python tools/models.py smollm2`, or pass the folder of a HF model you have.")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # architectures[0]: picks the model class
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    # mixture of experts; num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has experts (HF's rule): not listed in mlp_only_layers, and
        every decoder_sparse_step-th layer (step 1: all of them)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet")
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {hf['hidden_act']!r}: only silu is supported")
        if hf.get("sliding_window") and hf.get("use_sliding_window", True):
            raise NotImplementedError("sliding-window attention is not supported")
        heads = hf["num_attention_heads"]
        return cls(
            architecture=(hf.get("architectures") or ["LlamaForCausalLM"])[0],
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            num_qo_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=rope.get("rope_theta") or hf.get("rope_theta", 10000.0),
            max_position=hf["max_position_embeddings"],
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
            num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", False),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )
