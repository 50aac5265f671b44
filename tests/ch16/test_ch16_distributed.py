"""Chapter 16: the communicator on real processes over gloo, and the refusal of a head count
that does not divide."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from minisgl.distributed import (
    DistributedInfo,
    all_gather,
    all_reduce,
    broadcast,
    destroy_distributed,
    init_distributed,
)

from helpers import run_ranks


def _collectives(rank: int, size: int, rendezvous: str, out: mp.Queue) -> None:
    init_distributed(DistributedInfo(rank, size), torch.device("cpu"), rendezvous)
    try:
        x = torch.arange(4, dtype=torch.float32) + 10 * rank
        summed = all_reduce(x.clone())
        gathered = all_gather(x)
        b = broadcast(torch.full((3,), float(rank)), src=size - 1)
        out.put((rank, summed.tolist(), gathered.tolist(), b.tolist()))
    finally:
        destroy_distributed()


def _run_ranks(target: Callable[..., None], size: int, tmp_path: Path, *args: object
               ) -> list[tuple]:
    """target(rank, size, rendezvous, *args, out) on `size` real processes (run_ranks); their
    results, in rank order, after every rank exited 0."""
    results, exit_codes = run_ranks(target, size, tmp_path, *args)
    assert exit_codes == [0] * size
    return sorted(results)


@pytest.mark.parametrize("size", [1, 2, 4])  # 1: a group of one still goes through gloo
def test_collectives_across_real_processes(size: int, tmp_path: Path) -> None:
    results = _run_ranks(_collectives, size, tmp_path)
    rows = [[float(i + 10 * r) for i in range(4)] for r in range(size)]
    assert [r[0] for r in results] == list(range(size))  # every rank answered
    for _, summed, gathered, b in results:
        assert summed == [sum(col) for col in zip(*rows)]
        assert gathered == rows  # every rank's tensor, in rank order
        assert b == [float(size - 1)] * 3  # the last rank's value everywhere


def test_one_rank_needs_no_group() -> None:
    init_distributed(DistributedInfo(0, 1), torch.device("cpu"), "")
    assert not torch.distributed.is_initialized()
    x = torch.ones(3)
    assert all_reduce(x) is x and all_gather(x).shape == (1, 3) and broadcast(x) is x


def _agree(rank: int, size: int, rendezvous: str, free: list[int], out: mp.Queue) -> None:
    from minisgl.engine.engine import agree_free_memory

    init_distributed(DistributedInfo(rank, size), torch.device("cpu"), rendezvous)
    try:
        out.put((rank, agree_free_memory(free[rank], tolerance=2 << 30)))
    except RuntimeError as e:
        out.put((rank, str(e)))
    finally:
        destroy_distributed()


def test_free_memory_is_the_least_and_ranks_too_far_apart_are_refused(tmp_path: Path) -> None:
    ok = _run_ranks(_agree, 2, tmp_path / "a", [5 << 30, 4 << 30])
    assert ok == [(0, 4 << 30), (1, 4 << 30)]  # both ranks size their pool for the tightest
    refused = _run_ranks(_agree, 2, tmp_path / "b", [7 << 30, 4 << 30])
    for _, message in refused:  # every rank refuses, so none is left waiting for the others
        assert "4.00 to 7.00 GiB, more than 2 GiB apart" in message


def test_heads_that_do_not_divide_are_refused_by_number() -> None:
    with pytest.raises(ValueError, match=r"heads = 9 does not divide by tp = 2.*1, 3, 9"):
        DistributedInfo(0, 2).split(9, "num_attention_heads")  # SmolLM2's 9 heads
    assert DistributedInfo(1, 4).split(32, "num_attention_heads") == 8


def test_fanout_waits_for_every_subscriber_and_drops_nothing() -> None:
    """Rank 0's XPUB sees each of tp - 1 subscriptions (all to the same, empty topic: without
    XPUB_VERBOSE it would see only the first), and a burst far over ZMQ's default high-water
    mark of 1000 reaches every rank whole."""
    from minisgl.message import AbortBackendMsg, BackendMsg, encode
    from minisgl.message.transport import IpcNamespace, ZmqPubQueue, ZmqSubQueue

    ns = IpcNamespace()
    try:
        with ZmqPubQueue(ns.addr("fanout"), bind=True) as pub, \
                ZmqSubQueue(ns.addr("fanout"), bind=False, expected=BackendMsg) as s1, \
                ZmqSubQueue(ns.addr("fanout"), bind=False, expected=BackendMsg) as s2:
            pub.wait_subscribers(2, timeout_s=10)
            frames = [encode(AbortBackendMsg(i)) for i in range(5000)]
            for f in frames:
                pub.put_raw(f)
            for s in (s1, s2):
                got: list[bytes] = []
                while len(got) < len(frames) and (f := s.get_raw(timeout_ms=2000)) is not None:
                    got.append(f)
                assert got == frames  # no frame dropped, none out of order
    finally:
        ns.remove()
