"""Chapter 6's skeleton: batches filled by hand (rows, KV slots, positions); chapter 7's
scheduler replaces all of it (chapter 6)."""

from __future__ import annotations

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine import Engine


class HandBatcher:
    """The naive part left after chapter 6: table rows and KV pages from free lists, batches
    built by hand, every request prefilled together and then decoded together."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.page_size = engine.config.page_size
        self.free_rows = list(range(engine.config.max_running_req))
        self.free_pages = list(range(engine.num_pages))  # the extra last page is the dummy's
        self.pages: dict[int, list[int]] = {}  # uid -> its pages, in order

    def add(self, uid: int, prompt: list[int], params: SamplingParams) -> Req:
        ids = torch.tensor(prompt, dtype=torch.int32)
        req = Req(ids, self.free_rows.pop(0), 0, params.max_tokens, uid, params)
        self.pages[uid] = []
        return req

    def _place(self, req: Req) -> torch.Tensor:
        """KV slots for positions cached_len..device_len-1, written into the page table."""
        pages, ps = self.pages[req.uid], self.page_size
        while len(pages) * ps < req.device_len:
            pages.append(self.free_pages.pop(0))
        pos = torch.arange(req.cached_len, req.device_len)
        slots = torch.tensor(pages)[pos // ps] * ps + pos % ps
        self.engine.page_table[req.table_idx, req.cached_len : req.device_len] = slots.to(
            self.engine.page_table)
        return slots

    def make_batch(self, reqs: list[Req], phase: str) -> Batch:
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        dev = self.engine.device
        batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
        batch.input_ids = batch.input_ids.to(dev)
        batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
        batch.positions = batch.positions.to(dev)
        batch.out_loc = torch.cat([self._place(r) for r in reqs]).to(dev)
        batch.padded_reqs = reqs
        self.engine.attn_backend.prepare_metadata(batch)
        return batch

    def release(self, req: Req) -> None:
        self.free_pages += self.pages.pop(req.uid)
        self.free_rows.append(req.table_idx)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 eos_id: int | None = None) -> list[list[int]]:
        """All prompts in one prefill batch, then one decode batch per step until all finish."""
        reqs = [self.add(uid, p, params) for uid, p in enumerate(prompts)]
        outputs: dict[int, list[int]] = {r.uid: [] for r in reqs}
        running, phase = reqs, "prefill"
        while running:
            batch = self.make_batch(running, phase)
            out = self.engine.forward_batch(batch, self.engine.sampler.prepare(batch))
            out.copy_done.synchronize()
            still = []
            for req, token in zip(running, out.next_tokens_cpu.tolist()):
                req.append_host(torch.tensor([token]))
                outputs[req.uid].append(token)
                stop = token == eos_id and not req.sampling_params.ignore_eos
                if stop or len(outputs[req.uid]) >= req.sampling_params.max_tokens:
                    self.release(req)
                else:
                    still.append(req)
            running, phase = still, "decode"
        return [outputs[r.uid] for r in reqs]
