"""Chapter 1's skeleton: chapter 0's naive engine behind a forward() without arguments, plus
batches filled by hand; later chapters replace it piece by piece (chapter 1)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl.core import Batch, Req, SamplingParams, get_global_ctx

from naive import NaiveEngine


class ContextModel:
    """forward() takes no arguments: tokens, positions and requests come from the current
    batch in the global Context. Each request keeps its own naive KV cache, keyed by uid."""

    def __init__(self, model_dir: str | Path) -> None:
        self.engine = NaiveEngine(model_dir)  # the weights and the math of chapter 0
        self.caches: dict[int, tuple[list, list, int]] = {}

    def forward(self) -> torch.Tensor:
        batch, engine, start, logits = get_global_ctx().batch, self.engine, 0, []
        for req in batch.reqs:
            ids = batch.input_ids[start : start + req.extend_len]
            if int(batch.positions[start]) != req.cached_len:
                raise RuntimeError(f"{req}: first position {int(batch.positions[start])}")
            engine.reset()
            if req.uid in self.caches:  # swap this request's cache into the engine
                engine.k_cache, engine.v_cache, engine.length = self.caches[req.uid]
            logits.append(engine.forward(ids.tolist())[-1])  # last position only
            self.caches[req.uid] = (engine.k_cache, engine.v_cache, engine.length)
            start += req.extend_len
        return torch.stack(logits)


def make_batch(reqs: list[Req], phase: str) -> Batch:
    """Fill what the scheduler will fill from chapter 7 on: each request's new tokens
    (cached_len..device_len-1) and their positions, flattened into one sequence."""
    batch = Batch(reqs, phase)  # type: ignore[arg-type]
    batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
    batch.padded_reqs = reqs
    return batch


def generate(model: ContextModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
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
            req.complete_one()  # its K/V are cached; one slot reserved for `token`
            req.append_host(token)
    return [r.input_ids[len(p):].tolist() for r, p in zip(reqs, prompts)]
