"""BaseMoeBackend and the router's top-k choice that every MoE backend shares (chapter 20)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts: (weights [T, top_k] float32, ids [T, top_k] int64). The
    softmax runs over all experts in float32, as HF's router does; `renormalize`
    (norm_topk_prob) rescales the kept probabilities to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class BaseMoeBackend(ABC):
    """Runs one layer's experts. Weights: gate_up [E, 2I, H] (gate rows, then up rows) and
    down [E, H, I]; a tensor-parallel rank passes its I / tp share and sums afterwards."""

    supports_graphs = False  # whether a CUDA graph may capture it (no host reads)

    @abstractmethod
    def experts(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """out[t] = sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]), where
        expert_e(v) = down[e] @ (silu(gate_e v) * up_e v); [T, H] in x's dtype."""

    def forward(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        weights, ids = select_experts(router_logits, top_k, renormalize)
        return self.experts(x, gate_up, down, weights=weights, ids=ids)
