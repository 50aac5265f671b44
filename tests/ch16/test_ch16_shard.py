"""Chapter 16: the slices of every tensor, checked by simulating all ranks in one process: the
ranks' partial results, put together the way the collectives would, equal the full layer's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minisgl.distributed import DistributedInfo
from minisgl.distributed.shard import HeadSplit, shard_of
from minisgl.model_config import ModelConfig, load_hf_config
from minisgl.models.weight import load_weight, read_safetensors


def _take(t: torch.Tensor, name: str, config: ModelConfig, tp: DistributedInfo) -> torch.Tensor:
    """What rank tp.rank holds of t, padded as its layer would be."""
    s = shard_of(name, config, tp)
    if s.dim is None:
        return t
    part = t.narrow(s.dim, s.start, s.stop - s.start)
    pad = s.size - (s.stop - s.start)
    return F.pad(part, (0, 0, 0, pad)) if pad else part


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_put_together_give_the_full_layers(
        arch: str, tp: int, model_dir: Callable[[str], Path]) -> None:
    path = model_dir(arch)
    config = ModelConfig.from_hf(load_hf_config(path))
    [file] = sorted(path.glob("*.safetensors"))
    w = dict(read_safetensors(file))
    layer = "model.layers.0."
    ranks = [DistributedInfo(r, tp) for r in range(tp)]
    x = torch.randn(5, config.hidden_size, dtype=torch.float64)
    full = {k: v.double() for k, v in w.items()}

    # column-parallel: q/k/v and gate/up outputs are the ranks' outputs side by side
    for part in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj"):
        name = f"{layer}{part}.weight"
        pieces = [x @ _take(full[name], name, config, r).T for r in ranks]
        assert torch.allclose(torch.cat(pieces, -1), x @ full[name].T)
    # row-parallel: o_proj / down_proj outputs are the sum of the ranks' partial outputs
    for part, width in (("self_attn.o_proj", config.num_qo_heads * config.head_dim),
                        ("mlp.down_proj", config.intermediate_size)):
        name = f"{layer}{part}.weight"
        h = torch.randn(5, width, dtype=torch.float64)
        partial = [h.narrow(1, shard_of(name, config, r).start,
                            shard_of(name, config, r).size) @ _take(full[name], name, config, r).T
                   for r in ranks]
        assert torch.allclose(sum(partial), h @ full[name].T)  # the all-reduce
    # vocab-parallel embedding: each rank looks up its rows, zero elsewhere; the sum is the row
    emb = full["model.embed_tokens.weight"]
    ids = torch.tensor([0, 7, config.vocab_size - 1, 100])
    looked = []
    for r in ranks:
        s = shard_of("model.embed_tokens.weight", config, r)
        local = ids - s.start
        mine = (local >= 0) & (local < s.stop - s.start)
        rows = _take(emb, "model.embed_tokens.weight", config, r)[local.clamp(0, s.size - 1)]
        looked.append(rows * mine[:, None])
    assert torch.equal(sum(looked), emb[ids])
    # LM head: the ranks' logits gathered side by side, the padding trimmed
    logits = torch.cat([x @ _take(emb, "lm_head.weight", config, r).T for r in ranks], -1)
    assert torch.allclose(logits[:, :config.vocab_size], x @ emb.T)


def test_kv_heads_fewer_than_ranks_are_replicated(model_dir: Callable[[str], Path]) -> None:
    config = dataclasses.replace(
        ModelConfig.from_hf(load_hf_config(model_dir("tiny-qwen3"))), num_qo_heads=8,
        num_kv_heads=2)
    got = [HeadSplit.of(config, DistributedInfo(r, 4)) for r in range(4)]
    assert [(h.qo_heads, h.kv_heads, h.first_qo, h.first_kv) for h in got] == [
        (2, 1, 0, 0), (2, 1, 2, 0), (2, 1, 4, 1), (2, 1, 6, 1)]  # ranks 0-1 share KV head 0
    with pytest.raises(ValueError, match="num_key_value_heads = 3 is below tp = 4"):
        HeadSplit.of(dataclasses.replace(config, num_qo_heads=12, num_kv_heads=3),
                     DistributedInfo(0, 4))


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-mistral"])
def test_each_rank_reads_only_its_slice(arch: str, model_dir: Callable[[str], Path]) -> None:
    """load_weight with a rank's shards equals the full load cut the same way, and holds
    about 1/tp of the bytes (the norms are whole on every rank)."""
    path = model_dir(arch)
    config = ModelConfig.from_hf(load_hf_config(path))
    full = load_weight(path, torch.device("cpu"), torch.float32, config.tie_word_embeddings)
    tp = 2
    sizes = []
    for rank in range(tp):
        info = DistributedInfo(rank, tp)
        local = load_weight(path, torch.device("cpu"), torch.float32,
                            config.tie_word_embeddings, lambda n, i=info: shard_of(n, config, i))
        assert local.keys() == full.keys()
        heads = HeadSplit.of(config, info)
        d = config.head_dim
        for key, t in local.items():
            whole = full[key]
            if key.endswith("qkv_proj.weight"):
                q, k, v = whole.split([config.num_qo_heads * d, config.num_kv_heads * d,
                                       config.num_kv_heads * d])
                want = torch.cat([q[heads.first_qo * d:(heads.first_qo + heads.qo_heads) * d],
                                  k[heads.first_kv * d:(heads.first_kv + heads.kv_heads) * d],
                                  v[heads.first_kv * d:(heads.first_kv + heads.kv_heads) * d]])
            elif key.endswith("gate_up_proj.weight"):
                gate, up = whole.chunk(2)
                want = torch.cat([_take(gate, "x.gate_proj.weight", config, info),
                                  _take(up, "x.up_proj.weight", config, info)])
            else:
                hf_name = key.replace("qkv_proj", "q_proj")
                want = _take(whole, hf_name, config, info)
            assert torch.equal(t, want), key
        sizes.append(sum(t.numel() for t in local.values()))
    total = sum(t.numel() for t in full.values())
    assert all(s < 0.6 * total for s in sizes)  # about half each
