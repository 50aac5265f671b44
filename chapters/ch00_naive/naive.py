"""The naive engine of chapter 0: safetensors in, greedy tokens out, no minisgl (chapter 0)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


class NaiveConfig:
    """The handful of config.json fields a Qwen3 / Llama forward pass needs."""

    def __init__(self, cfg: dict) -> None:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED:
            raise ValueError(f"chapter 0 runs {', '.join(SUPPORTED)}; this model is {arch}")
        self.layers: int = cfg["num_hidden_layers"]
        self.heads: int = cfg["num_attention_heads"]
        self.kv_heads: int = cfg.get("num_key_value_heads") or self.heads
        self.head_dim: int = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps: float = cfg["rms_norm_eps"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_type {rope['rope_type']!r} is not in chapter 0")
        self.theta: float = rope.get("rope_theta") or cfg.get("rope_theta", 10000.0)
        self.tied: bool = cfg.get("tie_word_embeddings", False)


def load_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file, read into memory as `dtype`, keyed by HF name."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name.removeprefix("model.")] = f.get_tensor(name).to(dtype, copy=True)
    return weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate [T, H, D] by position: the two halves of the last dim form the (re, im) pairs."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = pos[:, None].float() * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class NaiveEngine:
    """One request at a time; the KV cache is a growing tensor per layer."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir}/config.json not found: make the model with "
                                    "`python tools/models.py tiny` or `... smollm2`")
        self.cfg = NaiveConfig(json.loads((model_dir / "config.json").read_text()))
        self.w = load_weights(model_dir, dtype)
        if "lm_head.weight" not in self.w:  # tied embeddings: the output layer is the input table
            self.w["lm_head.weight"] = self.w["embed_tokens.weight"]
        self.reset()

    def reset(self) -> None:
        self.k_cache: list[torch.Tensor | None] = [None] * self.cfg.layers
        self.v_cache: list[torch.Tensor | None] = [None] * self.cfg.layers
        self.length = 0  # tokens already in the cache

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def attention(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, p, t = self.cfg, f"layers.{i}.self_attn.", x.shape[0]
        q = self.linear(x, p + "q_proj").view(t, c.heads, c.head_dim)
        k = self.linear(x, p + "k_proj").view(t, c.kv_heads, c.head_dim)
        v = self.linear(x, p + "v_proj").view(t, c.kv_heads, c.head_dim)
        if p + "q_norm.weight" in self.w:  # Qwen3 normalises each head of q and k
            q = rms_norm(q, self.w[p + "q_norm.weight"], c.eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], c.eps)
        q, k = rope(q, pos, c.theta), rope(k, pos, c.theta)
        if self.k_cache[i] is not None:  # naive KV cache: append the new rows
            k = torch.cat([self.k_cache[i], k])
            v = torch.cat([self.v_cache[i], v])
        self.k_cache[i], self.v_cache[i] = k, v
        group = c.heads // c.kv_heads  # grouped-query attention: a kv head serves `group` q heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * c.head_dim**-0.5
        causal = torch.arange(k.shape[0])[None, :] > pos[:, None]  # key after query: hidden
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1, dtype=torch.float32)
        out = torch.einsum("hts,shd->thd", probs.to(v.dtype), v).reshape(t, -1)
        return self.linear(out, p + "o_proj")

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{i}.mlp."
        gate, up = self.linear(x, p + "gate_proj"), self.linear(x, p + "up_proj")
        return self.linear(torch.nn.functional.silu(gate) * up, p + "down_proj")

    @torch.no_grad()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Run new tokens `ids` after the cached ones; return their logits [len(ids), vocab]."""
        pos = torch.arange(self.length, self.length + len(ids))
        h = self.w["embed_tokens.weight"][torch.tensor(ids)]
        for i in range(self.cfg.layers):
            p = f"layers.{i}."
            h = h + self.attention(i, rms_norm(h, self.w[p + "input_layernorm.weight"],
                                               self.cfg.eps), pos)
            h = h + self.mlp(i, rms_norm(h, self.w[p + "post_attention_layernorm.weight"],
                                         self.cfg.eps))
        self.length += len(ids)
        h = rms_norm(h, self.w["norm.weight"], self.cfg.eps)
        return self.linear(h, "lm_head").float()

    def generate(self, prompt: list[int], max_new_tokens: int,
                 eos_id: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding: the prompt once (prefill), then one token per step (decode)."""
        self.reset()
        logits = self.forward(prompt)[-1]
        tokens, step_logits = [], []
        while True:
            step_logits.append(logits)
            tokens.append(int(logits.argmax()))
            if len(tokens) == max_new_tokens or tokens[-1] == eos_id:
                return tokens, step_logits
            logits = self.forward(tokens[-1:])[-1]
