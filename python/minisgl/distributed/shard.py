"""Which slice of each checkpoint tensor a tensor-parallel rank holds (chapter 16). One place
says it; the layers size their weights by it and the loader reads only that slice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .info import DistributedInfo

if TYPE_CHECKING:  # models import this module to load their slices
    from minisgl.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor; dim None: the whole of it.
    `size` is this rank's length along dim, padding included (the vocabulary's last rank)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    size: int = 0


@dataclass(frozen=True)
class HeadSplit:
    """Attention heads on one rank. With fewer KV heads than ranks, each KV head is kept
    whole on tp / num_kv_heads ranks: rank r holds KV head r * num_kv_heads // tp."""

    qo_heads: int
    kv_heads: int
    first_qo: int
    first_kv: int

    @classmethod
    def of(cls, config: ModelConfig, tp: DistributedInfo) -> HeadSplit:
        qo = tp.split(config.num_qo_heads, "num_attention_heads")
        hkv = config.num_kv_heads
        if hkv >= tp.size:
            kv = tp.split(hkv, "num_key_value_heads")
            return cls(qo, kv, tp.rank * qo, tp.rank * kv)
        if tp.size % hkv:
            raise ValueError(f"num_key_value_heads = {hkv} is below tp = {tp.size} and does not "
                             f"divide it: each KV head must sit whole on tp / {hkv} ranks")
        return cls(qo, 1, tp.rank * qo, tp.rank * hkv // tp.size)


def vocab_rows(vocab_size: int, tp: DistributedInfo) -> Shard:
    """The vocabulary is padded up to a multiple of tp; the last rank's padding rows are 0."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return Shard(0, start, min(start + per, vocab_size), per)


def shard_of(name: str, config: ModelConfig, tp: DistributedInfo) -> Shard:
    """This rank's slice of the HF tensor `name` (e.g. model.layers.3.self_attn.q_proj.weight)."""
    if tp.size == 1:
        return Shard()
    heads, d = HeadSplit.of(config, tp), config.head_dim
    *prefix, part, _kind = name.split(".")
    if part == "q_proj":
        return Shard(0, heads.first_qo * d, (heads.first_qo + heads.qo_heads) * d,
                     heads.qo_heads * d)
    if part in ("k_proj", "v_proj"):
        return Shard(0, heads.first_kv * d, (heads.first_kv + heads.kv_heads) * d,
                     heads.kv_heads * d)
    if part == "o_proj" and _kind == "weight":
        return Shard(1, heads.first_qo * d, (heads.first_qo + heads.qo_heads) * d,
                     heads.qo_heads * d)
    if part in ("gate_proj", "up_proj") or (part == "down_proj" and _kind == "weight"):
        # an expert (mlp.experts.E.*) is cut like the MLP, on its own width
        expert = len(prefix) > 1 and prefix[-2] == "experts"
        field = "moe_intermediate_size" if expert else "intermediate_size"
        inter = tp.split(getattr(config, field), field)
        return Shard(0 if part != "down_proj" else 1, tp.rank * inter, (tp.rank + 1) * inter,
                     inter)
    if part in ("embed_tokens", "lm_head"):
        return vocab_rows(config.vocab_size, tp)
    return Shard()  # norms, and the biases of o_proj / down_proj (added once, after the sum)


def local_config(config: ModelConfig, tp: DistributedInfo) -> ModelConfig:
    """The model as one rank sees it: its heads and its share of the MLP. The vocabulary stays
    whole here: the vocabulary layers cut it themselves (vocab_rows), as they must gather it
    back. Everything sized from the config (weights, the KV pool, attention) is then local.
    An MoE model's experts are cut like the MLP, on moe_intermediate_size; its
    intermediate_size is split only if some layer has a dense MLP."""
    if tp.size == 1:
        return config
    heads = HeadSplit.of(config, tp)
    layers = range(config.num_layers)
    dense, sparse = [[i for i in layers if config.is_moe_layer(i) == moe] for moe in (False, True)]
    inter, moe_inter = config.intermediate_size, config.moe_intermediate_size
    return dataclasses.replace(
        config, num_qo_heads=heads.qo_heads, num_kv_heads=heads.kv_heads,
        intermediate_size=tp.split(inter, "intermediate_size") if dense else inter,
        moe_intermediate_size=tp.split(moe_inter, "moe_intermediate_size") if sparse else 0)
