"""Chapter 22: retraction at tensor-parallel size 2 (CPU, gloo). Every rank runs the same
scheduler on the same inputs, so each makes the same retraction decisions; the tokens are those
of one rank, and of a pool that never retracts."""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path

import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo

from driver import RETRACT_LOG, prompts, reference
from helpers import run_ranks

BATCH, MAX_TOKENS = prompts(12), 48
CONFIG = {"num_page_override": 120, "schedule_conservativeness": 0.1}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _generate(path: str, tp: DistributedInfo, rendezvous: str) -> dict[str, object]:
    """The workload under pressure: tokens, counters, and the uids of each retraction."""
    from minisgl.llm import LLM

    lines = Lines()
    logging.getLogger("minisgl.scheduler").addHandler(lines)
    llm = LLM(path, dtype=torch.float32, tp_info=tp, dist_init=rendezvous, **CONFIG)
    try:
        out = llm.generate(BATCH, SamplingParams(max_tokens=MAX_TOKENS))
        s = llm.stats
        return {"tokens": [o["token_ids"] for o in out],
                "counts": (s.retractions, s.retracted_reqs, s.recomputed_tokens,
                           s.prefill_batches, s.decode_batches),
                "victims": [m.group(2) for line in lines.lines
                            if (m := RETRACT_LOG.search(line)) is not None]}
    finally:
        llm.shutdown()
        logging.getLogger("minisgl.scheduler").removeHandler(lines)


def _rank(rank: int, size: int, rendezvous: str, path: str, out: mp.Queue) -> None:
    out.put((rank, _generate(path, DistributedInfo(rank, size), rendezvous)))


def test_tp2_retracts_alike_on_every_rank(tmp_path: Path,
                                          model_dir: Callable[[str], Path]) -> None:
    path = model_dir("tiny-qwen3")
    expected = reference(path, tuple(map(tuple, BATCH)), MAX_TOKENS)
    # one rank in a process of its own too: a scheduler that can never finish fails the test
    # at the timeout instead of hanging it
    [(_, one)], _ = run_ranks(_rank, 1, tmp_path / "one", str(path), timeout_s=120)
    assert one["tokens"] == expected and one["victims"]
    results, codes = run_ranks(_rank, 2, tmp_path / "two", str(path), timeout_s=180)
    assert codes == [0, 0]
    for _, got in results:
        assert got == one  # the same tokens, counters and victims as one rank
