"""Chapter 2's skeleton: the network assembled by hand from chapter 2's layers; config,
weight loading, attention and its KV cache are still naive here (chapter 2)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
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


class Attention(BaseOP):
    def __init__(self, c: dict, rotary: RotaryEmbedding) -> None:
        self.hq, self.hkv, self.d = c["heads"], c["kv_heads"], c["head_dim"]
        self.qkv_proj = LinearQKVMerged(c["hidden"], self.d, self.hq, self.hkv, c["qkv_bias"])
        self.q_norm = RMSNorm(self.d, c["eps"]) if c["qk_norm"] else None
        self.k_norm = RMSNorm(self.d, c["eps"]) if c["qk_norm"] else None
        self.o_proj = LinearOProj(self.hq * self.d, c["hidden"])
        self._rotary = rotary
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # naive, per uid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = get_global_ctx().batch
        q, k, v = self.qkv_proj.forward(x).split(
            [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm.forward(q.reshape(-1, self.hq, self.d))
            k = self.k_norm.forward(k.reshape(-1, self.hkv, self.d))
        q, k = self._rotary.forward(batch.positions, q, k)
        q, k = q.view(-1, self.hq, self.d), k.view(-1, self.hkv, self.d)
        v = v.reshape(-1, self.hkv, self.d)
        out, start = torch.empty_like(q), 0
        for req in batch.reqs:
            end = start + req.extend_len
            ks, vs = k[start:end], v[start:end]
            if req.uid in self._caches:
                ks = torch.cat([self._caches[req.uid][0], ks])
                vs = torch.cat([self._caches[req.uid][1], vs])
            self._caches[req.uid] = (ks, vs)
            group = self.hq // self.hkv
            ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            scores = torch.einsum("thd,shd->hts", q[start:end], ks) * self.d**-0.5
            hidden = torch.arange(len(ks))[None, :] > batch.positions[start:end, None]
            probs = scores.masked_fill(hidden, float("-inf")).softmax(-1, dtype=torch.float32)
            out[start:end] = torch.einsum("hts,shd->thd", probs.to(vs.dtype), vs)
            start = end
        return self.o_proj.forward(out.flatten(1))


class MLP(BaseOP):
    def __init__(self, c: dict) -> None:
        self.gate_up_proj = LinearColParallelMerged(c["hidden"], [c["inter"], c["inter"]])
        self.down_proj = LinearRowParallel(c["inter"], c["hidden"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class Block(BaseOP):
    def __init__(self, c: dict, rotary: RotaryEmbedding) -> None:
        self.input_layernorm = RMSNormFused(c["hidden"], c["eps"])
        self.self_attn = Attention(c, rotary)
        self.post_attention_layernorm = RMSNormFused(c["hidden"], c["eps"])
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        x, residual = self.input_layernorm.forward(x, residual)
        x, residual = self.post_attention_layernorm.forward(self.self_attn.forward(x), residual)
        return self.mlp.forward(x), residual


class Decoder(BaseOP):
    def __init__(self, c: dict) -> None:
        rotary = RotaryEmbedding(c["head_dim"], c["max_pos"], c["theta"])
        self.embed_tokens = VocabParallelEmbedding(c["vocab"], c["hidden"])
        self.layers = OPList([Block(c, rotary) for _ in range(c["layers"])])
        self.norm = RMSNormFused(c["hidden"], c["eps"])


class LayeredModel(BaseOP):
    """HF's layout, `model.*` and `lm_head`, so that the state dict names match the file's."""

    def __init__(self, model_dir: str | Path) -> None:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        rope = hf.get("rope_parameters") or {}
        c = dict(hidden=hf["hidden_size"], inter=hf["intermediate_size"],
                 vocab=hf["vocab_size"], layers=hf["num_hidden_layers"],
                 heads=hf["num_attention_heads"], kv_heads=hf["num_key_value_heads"],
                 eps=hf["rms_norm_eps"], max_pos=hf["max_position_embeddings"],
                 theta=rope.get("rope_theta") or hf.get("rope_theta", 10000.0),
                 qk_norm=hf["model_type"] == "qwen3", qkv_bias=hf["model_type"] == "qwen2")
        c["head_dim"] = hf.get("head_dim") or c["hidden"] // c["heads"]
        self.model = Decoder(c)
        tied = self.model.embed_tokens if hf.get("tie_word_embeddings") else None
        self.lm_head = ParallelLMHead(c["vocab"], c["hidden"], tied)
        self.load_state_dict(naive_load(Path(model_dir), tied is not None))

    def forward(self) -> torch.Tensor:
        x, residual = self.model.embed_tokens.forward(get_global_ctx().batch.input_ids), None
        for block in self.model.layers.op_list:
            x, residual = block.forward(x, residual)
        return self.lm_head.forward(self.model.norm.forward(x, residual)[0])


def naive_load(model_dir: Path, tied: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, with q/k/v and gate/up stacked the way our merged
    linear layers want them (chapter 3 turns this into proper weight loading)."""
    w: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            w.update({name: f.get_tensor(name).float() for name in f.keys()})
    if tied:
        w.pop("lm_head.weight", None)
    for name in [n for n in w if ".q_proj." in n]:
        parts = [w.pop(name.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        w[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    for name in [n for n in w if ".gate_proj." in n]:
        parts = [w.pop(name.replace("gate_proj", p)) for p in ("gate_proj", "up_proj")]
        w[name.replace("gate_proj", "gate_up_proj")] = torch.cat(parts)
    return w


def make_batch(reqs: list[Req], phase: str) -> Batch:
    batch = Batch(reqs, phase)  # type: ignore[arg-type]
    batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
    batch.padded_reqs = reqs
    return batch


def generate(model: LayeredModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
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
