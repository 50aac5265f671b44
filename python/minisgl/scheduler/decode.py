"""DecodeManager: the running requests, decoded together every step (chapter 7)."""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.core import Batch, Req

from .admission import NewTokenRatio


class DecodeManager:
    def __init__(self, page_size: int, ratio: NewTokenRatio | None = None) -> None:
        self.page_size = page_size
        self.ratio = ratio  # None: each running request keeps all of its remaining output
        self.running: dict[int, Req] = {}  # uid -> request

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        """After a batch is launched: its requests that may still decode join (or stay in) the
        running set; the ones that reached their length limit leave."""
        for req in reqs:
            if req.can_decode:
                self.running[req.uid] = req
            else:
                self.running.pop(req.uid, None)

    def remove_req(self, req: Req) -> None:
        self.running.pop(req.uid, None)

    @property
    def inflight_tokens(self) -> int:
        """KV tokens promised to the running requests: their remaining output (with a ratio,
        the part of it they are expected to use), plus up to a page each of rounding, since
        pages are allocated whole."""
        if self.ratio is None:
            return sum(r.remain_len + self.page_size - 1 for r in self.running.values())
        need = self.ratio.expected_need
        return sum(need(r) + self.page_size - 1 for r in self.running.values())

    def schedule_next_batch(self) -> Batch | None:
        if not self.running:
            return None
        return Batch(self.reqs, "decode")

    @property
    def reqs(self) -> list[Req]:
        """The running requests by uid: the same order on every tensor-parallel rank."""
        return [self.running[uid] for uid in sorted(self.running)]

    @property
    def runnable(self) -> bool:
        return bool(self.running)
