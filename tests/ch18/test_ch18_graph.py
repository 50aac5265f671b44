"""Chapter 18: graph capture and replay. On the CPU the graphs are EmulatedGraphs: replay runs the
captured step again on the captured batch, so it sees only what the static buffers hold; an input
the runner forgets to copy gives a wrong answer, as with a real CUDA graph. The same replays with
real CUDA graphs run on the H200 (tests/gpu/test_gpu_backends.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine.graph import EmulatedGraph, GraphRunner, graph_batch_sizes

from helpers import shell_session
from reference import hf_greedy

FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.mark.parametrize("max_bs,max_running,expected", [
    (0, 256, []),
    (1, 256, [1]),
    (3, 256, [1, 2, 3]),
    (8, 256, [1, 2, 4, 8]),
    (20, 256, [1, 2, 4, 8, 16, 20]),  # the top size itself, not rounded down to 16
    (256, 12, [1, 2, 4, 8, 12]),  # never past the largest batch that can exist
])
def test_graph_batch_sizes(max_bs: int, max_running: int, expected: list[int]) -> None:
    assert graph_batch_sizes(max_bs, max_running) == expected


def test_capture_refuses_a_host_read() -> None:
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="reads a tensor's value on the host"):
        EmulatedGraph().capture(lambda: print(int(x.sum())))


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """8 requests that stop one after another, so decode batches take every size 8..1."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in
               (5, 17, 1, 30, 9, 12, 3, 22)]
    return prompts, [SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True) for i in range(8)]


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(batch size, padded size) of every replay."""
    seen: list[tuple[int, int]] = []
    replay = GraphRunner.replay

    def spy(self: GraphRunner, batch: Any) -> torch.Tensor:
        seen.append((batch.size, batch.padded_size))
        return replay(self, batch)

    monkeypatch.setattr(GraphRunner, "replay", spy)
    return seen


def _eager_tokens(make_llm: Callable, path: Path, **config: Any) -> list[list[int]]:
    prompts, params = _workload(0)
    llm = make_llm(path, cuda_graph_max_bs=0, max_seq_len_override=256, **config)
    out = [o["token_ids"] for o in llm.generate(prompts, params)]
    llm.shutdown()
    return out


@pytest.fixture
def eager_tokens(make_llm: Callable, model_dir: Callable[[str], Path]) -> list[list[int]]:
    return _eager_tokens(make_llm, model_dir("tiny-qwen3"))


def _graph_tokens(make_llm: Callable, path: Path, max_bs: int = 6,
                  **config: Any) -> list[list[int]]:
    prompts, params = _workload(0)
    llm = make_llm(path, cuda_graph_max_bs=max_bs, max_seq_len_override=256, **config)
    assert sorted(llm.engine.graph_runner.graphs) == graph_batch_sizes(max_bs, 256)
    # noise in every slot no step has written yet: the pool is torch.empty, and the allocator
    # may hand back the eager run's memory with its keys and values still in it. A correct
    # replay never reads an unwritten slot; one that writes to stale slots must not get lucky.
    llm.engine.kv_cache._buffer.normal_(generator=torch.Generator().manual_seed(1))
    out = [o["token_ids"] for o in llm.generate(prompts, params)]
    llm.shutdown()
    return out


@pytest.mark.parametrize("arch,page_size,cache_type", [
    ("tiny-qwen3", 1, "radix"), ("tiny-llama", 4, "radix"), ("tiny-qwen2", 1, "naive"),
    ("tiny-mistral", 4, "naive")])
def test_replay_gives_the_eager_tokens_on_every_size_and_padded_size(
        arch: str, page_size: int, cache_type: str, replays: list[tuple[int, int]],
        make_llm: Callable, model_dir: Callable[[str], Path]) -> None:
    path, config = model_dir(arch), dict(page_size=page_size, cache_type=cache_type)
    eager = _eager_tokens(make_llm, path, **config)
    assert _graph_tokens(make_llm, path, **config) == eager
    # sizes 1..6 replayed, 3 and 5 padded to 4 and 6; 7 and 8 (above the largest) ran eagerly
    assert set(replays) == {(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (6, 6)}
    prompts, _ = _workload(0)  # and eager is HF (the longest answer: every size decoded it)
    assert eager[7] == hf_greedy(path, prompts[7], 18)[0]


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    import flashinfer

    assert "fakes" in flashinfer.__file__
    yield flashinfer
    sys.modules.pop("flashinfer", None)


def test_fi_graph_wrappers_read_their_fixed_buffers(
        fake_flashinfer: Any, eager_tokens: list[list[int]], replays: list[tuple[int, int]],
        make_llm: Callable, model_dir: Callable[[str], Path]) -> None:
    """The fake's graph-mode wrapper reads the layout from its buffers at run time, as the
    captured kernels do: only a replan into them gives the right keys."""
    assert _graph_tokens(make_llm, model_dir("tiny-qwen3"), attention_backend="fi") == eager_tokens
    assert len(replays) > 6


@pytest.mark.parametrize("missed", ["input_ids", "positions", "out_loc", "attention metadata"])
def test_a_missed_replay_copy_changes_the_output(
        missed: str, eager_tokens: list[list[int]], make_llm: Callable,
        model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant the bug a graph runner can have: one input not copied into its static buffer.
    The replay then computes with a stale value, and the tokens change. Every decode step is
    replayed here (largest size 8)."""
    if missed == "attention metadata":
        from minisgl.attention.torch_backend import TorchBackend

        monkeypatch.setattr(TorchBackend, "prepare_for_replay", lambda self, batch: None)
    else:
        monkeypatch.setattr(GraphRunner, "INPUTS",
                            tuple(n for n in GraphRunner.INPUTS if n != missed))
    assert _graph_tokens(make_llm, model_dir("tiny-qwen3"), max_bs=8) != eager_tokens


def test_the_hopper_pair_replays_its_decode_backends_graphs(
        fake_flashinfer: Any, eager_tokens: list[list[int]], replays: list[tuple[int, int]],
        make_llm: Callable, model_dir: Callable[[str], Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fa,fi: prefill by the fake FlashAttention (never captured), decode graphs by fi's."""
    for name in ("sgl_kernel", "sgl_kernel.flash_attn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    tokens = _graph_tokens(make_llm, model_dir("tiny-qwen3"), attention_backend="fa,fi")
    assert tokens == eager_tokens and len(replays) > 6


def test_the_shell_with_graphs(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """`--shell --cuda-graph-max-bs 2`: the scheduler process logs the graphs it made."""
    stderr = shell_session(model_dir("tiny-qwen3"), tmp_path, "--cuda-graph-max-bs", "2")
    assert "emulated 2 graphs (batch sizes [1, 2])" in stderr
