"""Chapters 17 and 18 on CUDA: our fi backend on the real FlashInfer against our torch backend,
and real CUDA graph replay against eager."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gpu_common import BF16_TOL, MODELS, generate_logged, relative_errors

from minisgl.core import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]

NO_FLASHINFER = "flashinfer is not installed (pip install flashinfer-python==0.5.3)"
FI_COMMON = dict(dtype=torch.bfloat16, num_page_override=8192, max_running_req=16,
                 cache_type="naive", cuda_graph_max_bs=0)
FI_PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)

Run = tuple[list[list[int]], list[list[int]], list[torch.Tensor]]  # prompts, tokens, logits


@pytest.fixture(scope="module")
def torch_backend_run(q06: Path) -> Run:
    """The reference for fi: 4 prompts (37, 120, 300 and 511 random ids, seed 0), 32 tokens
    each, bfloat16, the torch backend, graphs off (the backends alone), overlap on."""
    pytest.importorskip("flashinfer", reason=NO_FLASHINFER)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 150000, (n,), generator=g).tolist() for n in (37, 120, 300, 511)]
    tokens, logits = generate_logged(q06, prompts, FI_PARAMS, attention_backend="torch",
                                     **FI_COMMON)
    return prompts, tokens, logits


@pytest.mark.parametrize("page_size,overlap", [(1, True), (4, True), (1, False)])
def test_fi_equals_torch_backend(page_size: int, overlap: bool, q06: Path,
                                 torch_backend_run: Run) -> None:
    """Chapter 17 on the Qwen3-0.6B shape (FlashInfer has no float32 kernels, nor head_dim 16
    or 32, so the tiny models cannot run it): teacher-forced relative logits error within
    BF16_TOL; greedy tokens alike are reported, not required (bfloat16 may flip a near tie)."""
    prompts, ref, ref_logits = torch_backend_run
    got, logits = generate_logged(q06, prompts, FI_PARAMS, attention_backend="fi",
                                  page_size=page_size, overlap=overlap, **FI_COMMON)
    errs = relative_errors(got, ref, logits, ref_logits)
    assert errs, "no step to compare"
    same = sum(a == b for a, b in zip(got, ref))
    assert max(errs) <= BF16_TOL, (
        f"fi vs torch backend: relative logits error max {max(errs):.2e} over {len(errs)} "
        f"teacher-forced steps (limit {BF16_TOL:g}); {same}/4 requests give all 32 tokens alike")


GRAPH_LENS = (5, 17, 1, 30, 9, 12, 3, 22)  # 8 requests that stop one after another
# (size, padded size) that graphs up to 6 must replay: 1, 2, 4, 6 as they are, 3 and 5 padded
GRAPH_REPLAYS = {(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (6, 6)}
GRAPH_RUNS = [(name, torch.float32, "torch") for name in MODELS] + [("q06", torch.bfloat16, "fi")]


@pytest.mark.parametrize("name,dtype,attn", GRAPH_RUNS, ids=[r[0] for r in GRAPH_RUNS])
def test_graph_replay_equals_eager(name: str, dtype: torch.dtype, attn: str,
                                   model_path: Callable[[str], Path],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Chapter 18: 8 requests stopping one after another make decode batches of every size
    8..1; graphs up to 6 replay sizes 1, 2, 4, 6 and pad 3 and 5; 7 and 8 run eagerly. Tiny
    models in float32 (torch backend), fi on the Qwen3-0.6B shape in bfloat16."""
    import transformers

    from minisgl.engine.graph import GraphRunner

    if attn == "fi":
        pytest.importorskip("flashinfer", reason=NO_FLASHINFER)
    replays: list[tuple[int, int]] = []
    replay = GraphRunner.replay

    def spy(self: GraphRunner, batch: object) -> torch.Tensor:
        replays.append((batch.size, batch.padded_size))  # type: ignore[attr-defined]
        return replay(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(GraphRunner, "replay", spy)
    path = model_path(name)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in GRAPH_LENS]
    params = [SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True) for i in range(8)]
    common = dict(dtype=dtype, num_page_override=4096, max_seq_len_override=512,
                  attention_backend=attn)
    eager, eager_logits = generate_logged(path, prompts, params, cuda_graph_max_bs=0, **common)
    replays.clear()
    graph, logits = generate_logged(path, prompts, params, cuda_graph_max_bs=6, **common)
    # batches shrink as requests stop: rows are compared while both runs are step for step
    errs = [float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())
            for a, b in zip(logits, eager_logits) if a.shape == b.shape] or [float("nan")]
    differ = [i for i, (a, b) in enumerate(zip(graph, eager)) if a != b]
    assert not differ, (f"replay gives eager's tokens for {8 - len(differ)}/8 requests (not "
                        f"{differ}); relative logits error vs eager max {max(errs):.1e}")
    missing = GRAPH_REPLAYS - set(replays)
    assert not missing, (f"(size, padded) never replayed: {sorted(missing)}; replayed "
                         f"{sorted(set(replays))}")
