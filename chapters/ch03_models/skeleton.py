"""Chapter 3's skeleton: a naive KV cache and a naive attention backend behind the interfaces
AttentionLayer calls, and batches filled by hand (chapter 3)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.models import BaseLLMModel, ModelConfig, create_model, load_hf_config, load_weight


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> BaseLLMModel:
    """Build on the meta device (no memory), then let the checkpoint's tensors replace the
    placeholders. Chapter 6's Engine does exactly this."""
    config = ModelConfig.from_hf(load_hf_config(model_dir))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the placeholders must have the dtype of the weights
    try:
        with torch.device("meta"):
            model = create_model(config)
    finally:
        torch.set_default_dtype(default)
    model.load_state_dict(load_weight(model_dir, torch.device("cpu"), dtype,
                                      config.tie_word_embeddings))
    return model


class NaiveKVCache:
    """What ctx.kv_cache does in this chapter: per request and layer, a tensor that grows by
    torch.cat. It ignores out_loc: it finds each row's request from the batch instead."""

    def __init__(self) -> None:
        self.k: dict[tuple[int, int], torch.Tensor] = {}  # (uid, layer) -> [S, Hkv, D]
        self.v: dict[tuple[int, int], torch.Tensor] = {}

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        start = 0
        for req in get_global_ctx().batch.reqs:
            key, end = (req.uid, layer_id), start + req.extend_len
            old_k = self.k.get(key, k[:0])
            old_v = self.v.get(key, v[:0])
            self.k[key] = torch.cat([old_k, k[start:end]])
            self.v[key] = torch.cat([old_v, v[start:end]])
            start = end


class NaiveAttnBackend:
    """What ctx.attn_backend does in this chapter: causal attention per request over the
    naive cache (which already holds this step's k and v)."""

    def __init__(self, cache: NaiveKVCache) -> None:
        self.cache = cache

    def prepare_metadata(self, batch: Batch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        out, start = torch.empty_like(q), 0
        for req in batch.reqs:
            end = start + req.extend_len
            ks, vs = self.cache.k[req.uid, layer_id], self.cache.v[req.uid, layer_id]
            group = q.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            scores = torch.einsum("thd,shd->hts", q[start:end], ks) * q.shape[-1] ** -0.5
            hidden = torch.arange(len(ks))[None, :] > batch.positions[start:end, None]
            probs = scores.masked_fill(hidden, float("-inf")).softmax(-1, dtype=torch.float32)
            out[start:end] = torch.einsum("hts,shd->thd", probs.to(vs.dtype), vs)
            start = end
        return out


def install_naive_attention() -> None:
    """Put the naive cache and backend into the global Context."""
    ctx = get_global_ctx()
    cache = NaiveKVCache()
    ctx.kv_cache = cache  # type: ignore[assignment]
    ctx.attn_backend = NaiveAttnBackend(cache)  # type: ignore[assignment]


def make_batch(reqs: list[Req], phase: str) -> Batch:
    batch = Batch(reqs, phase)  # type: ignore[arg-type]
    batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
    batch.out_loc = torch.zeros_like(batch.positions)  # unused by the naive cache
    batch.padded_reqs = reqs
    return batch


def generate(model: BaseLLMModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy: all prompts in one prefill batch, then one decode batch per step."""
    ctx = get_global_ctx()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [Req(torch.tensor(p, dtype=torch.int32), i, 0, max_tokens, i, params)
            for i, p in enumerate(prompts)]
    for step in range(max_tokens):
        batch = make_batch(reqs, "prefill" if step == 0 else "decode")
        with ctx.forward_batch(batch):
            logits = model.forward()
        for req, token in zip(reqs, logits.argmax(-1)):
            req.complete_one()
            req.append_host(token)
    return [r.input_ids[len(p):].tolist() for r, p in zip(reqs, prompts)]
