"""Chapter 5's skeleton: the model, pool, page table and attention backend are real; tables
rows and KV slots are still handed out by hand, and decoding is a greedy loop (chapter 5)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl.attention import create_attention_backend
from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.kvcache import create_kvcache_pool
from minisgl.models import BaseLLMModel, ModelConfig, create_model, load_hf_config, load_weight


def load_model(model_dir: str | Path) -> tuple[BaseLLMModel, ModelConfig]:
    config = ModelConfig.from_hf(load_hf_config(model_dir))
    with torch.device("meta"):
        model = create_model(config)
    model.load_state_dict(load_weight(model_dir, torch.device("cpu"), torch.float32,
                                      config.tie_word_embeddings))
    return model, config


class PagedBatcher:
    """Creates the pool and the page table and fills batches by hand: a request gets a table
    row when it arrives and a new page whenever its length crosses a page boundary."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int,
                 max_running_req: int, max_seq_len: int) -> None:
        ctx = get_global_ctx()
        self.page_size = page_size
        # one extra page (the last) for padding requests; one extra table row for the dummy
        ctx.kv_cache = create_kvcache_pool(config, num_pages + 1, page_size,
                                           torch.device("cpu"), torch.float32)
        ctx.page_table = torch.zeros((max_running_req + 1, max_seq_len), dtype=torch.int32)
        ctx.attn_backend = create_attention_backend("torch", config)
        self.free_rows = list(range(max_running_req))
        self.free_pages = list(range(num_pages))
        self.pages: dict[int, list[int]] = {}

    def add(self, uid: int, prompt: list[int], max_tokens: int) -> Req:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.pages[uid] = []
        return Req(torch.tensor(prompt, dtype=torch.int32), self.free_rows.pop(0), 0, max_tokens,
                   uid, params)

    def place(self, req: Req) -> torch.Tensor:
        """Slots for positions cached_len..device_len-1, recorded in the request's table row."""
        pages, ps = self.pages[req.uid], self.page_size
        while len(pages) * ps < req.device_len:
            pages.append(self.free_pages.pop(0))
        pos = torch.arange(req.cached_len, req.device_len)
        slots = torch.tensor(pages)[pos // ps] * ps + pos % ps
        get_global_ctx().page_table[req.table_idx, req.cached_len : req.device_len] = slots
        return slots

    def make_batch(self, reqs: list[Req], phase: str) -> Batch:
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
        batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
        batch.out_loc = torch.cat([self.place(r) for r in reqs])
        batch.padded_reqs = reqs
        get_global_ctx().attn_backend.prepare_metadata(batch)  # once per batch, for all layers
        return batch

    def generate(self, model: BaseLLMModel, prompts: list[list[int]],
                 max_tokens: int) -> list[list[int]]:
        ctx = get_global_ctx()
        reqs = [self.add(i, p, max_tokens) for i, p in enumerate(prompts)]
        for step in range(max_tokens):
            batch = self.make_batch(reqs, "prefill" if step == 0 else "decode")
            with ctx.forward_batch(batch):
                logits = model.forward()
            for req, token in zip(reqs, logits.argmax(-1)):
                req.complete_one()
                req.append_host(token)
        for req in reqs:  # give rows and pages back
            self.free_pages += self.pages.pop(req.uid)
            self.free_rows.append(req.table_idx)
        return [r.input_ids[len(p):].tolist() for r, p in zip(reqs, prompts)]
