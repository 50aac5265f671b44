"""Chapter 17: our FlashInfer backend against a fake `flashinfer` on the CPU. The fake has
FlashInfer 0.5.3's signatures and checks every argument we pass (int32 host indptrs, slot
indices, last page lengths, causal, scale, dtypes, the NHD cache); its attention is plain torch.
What is checked here is our side of the interface, not FlashInfer's kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.core import SamplingParams

from reference import hf_greedy

FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    import flashinfer

    assert "fakes" in flashinfer.__file__
    flashinfer.calls.clear()
    yield flashinfer
    sys.modules.pop("flashinfer", None)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()  # a prefix the radix cache reuses
    return [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 1, 30)]


@pytest.mark.parametrize("arch,page_size,cache_type", [
    ("tiny-qwen3", 1, "radix"), ("tiny-llama", 4, "radix"), ("tiny-qwen2", 1, "naive"),
    ("tiny-mistral", 4, "naive")])
def test_fi_backend_gives_the_torch_backends_tokens_and_plans_once_per_batch(
        arch: str, page_size: int, cache_type: str, fake_flashinfer: Any, make_llm: Callable,
        model_dir: Callable[[str], Path]) -> None:
    path, prompts = model_dir(arch), _prompts(0)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    config = dict(page_size=page_size, max_extend_tokens=32,  # long prompts come in chunks
                  cache_type=cache_type)
    torch_llm = make_llm(path, attention_backend="torch", **config)
    ref = torch_llm.generate(prompts, params)
    torch_llm.shutdown()  # one engine per process at a time
    llm = make_llm(path, attention_backend="fi", **config)
    out = llm.generate(prompts, params)
    assert [o["token_ids"] for o in out] == [r["token_ids"] for r in ref]
    plans = [kind for kind, what in fake_flashinfer.calls if what == "plan"]
    runs = sum(what == "run" for _, what in fake_flashinfer.calls)
    stats = llm.stats
    assert plans.count("prefill") == stats.prefill_batches and stats.prefill_batches > 1
    assert plans.count("decode") == stats.decode_batches
    assert runs == len(plans) * llm.engine.local_config.num_layers  # plan once, run per layer
    # and the torch backend's tokens are HF's (the independent reference)
    assert out[1]["token_ids"] == hf_greedy(path, prompts[1], 10)[0]


@pytest.mark.parametrize("few", [0, 64])
def test_fi_key_slots_copied_row_by_row_or_gathered_give_the_same_tokens(
        few: int, fake_flashinfer: Any, make_llm: Callable, model_dir: Callable[[str], Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of building a batch's key slots (a copy per row for small batches, one gather
    for large ones), each forced on every batch, prefill and decode, with pages of 4."""
    import minisgl.attention.fi as fi

    monkeypatch.setattr(fi, "FEW_REQS", few)
    path, prompts = model_dir("tiny-llama"), _prompts(2) + _prompts(3)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    torch_llm = make_llm(path, attention_backend="torch", page_size=4)
    ref = torch_llm.generate(prompts, params)
    torch_llm.shutdown()
    llm = make_llm(path, attention_backend="fi", page_size=4)
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == [
        r["token_ids"] for r in ref]


def test_the_fake_flashinfer_refuses_a_keyword_flashinfer_lacks(fake_flashinfer: Any) -> None:
    """The fake's wrappers take FlashInfer 0.5.3's parameters by name and nothing else, so a
    misspelled keyword in our backend fails on the CPU as it would on the GPU."""
    ws = torch.empty(8, dtype=torch.uint8)
    decode = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    with pytest.raises(TypeError, match="use_tensor_core"):
        fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_core=True)
    with pytest.raises(TypeError, match="backnd"):
        fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backnd="fa2")
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="sm_scal"):
        decode.plan(one, one[:1], one[1:], num_qo_heads=2, num_kv_heads=1, head_dim=8,
                    page_size=1, sm_scal=0.1)


def test_hybrid_prefills_with_torch_and_decodes_with_fi(fake_flashinfer: Any,
                                                       make_llm: Callable,
                                                       model_dir: Callable[[str], Path]) -> None:
    path, prompts = model_dir("tiny-qwen3"), _prompts(1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    torch_llm = make_llm(path, attention_backend="torch")
    ref = torch_llm.generate(prompts, params)
    torch_llm.shutdown()
    llm = make_llm(path, attention_backend="torch,fi")
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == [
        r["token_ids"] for r in ref]
    plans = [kind for kind, what in fake_flashinfer.calls if what == "plan"]
    assert plans == ["decode"] * llm.stats.decode_batches  # no prefill ever reached FlashInfer


@pytest.mark.parametrize("capability,installed,expected,level", [
    (None, {"flashinfer", "sgl_kernel"}, "torch", "INFO"),  # the CPU
    ((9, 0), {"flashinfer", "sgl_kernel"}, "fa,fi", "INFO"),  # Hopper with both
    ((9, 0), {"flashinfer"}, "fi", "INFO"),  # Hopper without sgl-kernel
    ((8, 0), {"flashinfer", "sgl_kernel"}, "fi", "INFO"),  # Ampere: FA3 needs Hopper
    ((10, 0), {"flashinfer", "sgl_kernel"}, "fi", "INFO"),  # Blackwell: FA3 is not for it
    ((9, 0), set(), "torch", "WARNING"),  # a GPU without FlashInfer: slow, said loudly
])
def test_auto_chooses_by_gpu_generation_and_installed_packages(
        capability: tuple[int, int] | None, installed: set[str], expected: str, level: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import importlib.util

    from minisgl.attention import resolve_backend_name

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in installed else None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = torch.device("cpu" if capability is None else "cuda")
    with caplog.at_level("INFO", logger="minisgl.attention"):
        assert resolve_backend_name("auto", device) == expected
    [record] = caplog.records  # one line, naming the choice
    assert record.levelname == level and f"--attn auto -> {expected} (" in record.message


def test_bad_names_are_refused_with_the_choices() -> None:
    from minisgl.attention import resolve_backend_name

    with pytest.raises(KeyError, match="unknown attention backend 'fa3'; choose from: fa, fi"):
        resolve_backend_name("torch,fa3", torch.device("cpu"))
    with pytest.raises(ValueError, match="PREFILL,DECODE"):
        resolve_backend_name("fi,fi,fi", torch.device("cpu"))


@pytest.fixture
def fake_sgl_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(FAKES))
    for name in ("sgl_kernel", "sgl_kernel.flash_attn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from sgl_kernel import flash_attn

    assert "fakes" in flash_attn.__file__
    flash_attn.calls.clear()
    yield flash_attn
    for name in ("sgl_kernel", "sgl_kernel.flash_attn"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("page_size", [1, 4])
def test_fa_backend_and_the_fa_fi_pair_give_the_torch_backends_tokens(
        page_size: int, fake_sgl_kernel: Any, fake_flashinfer: Any, make_llm: Callable,
        model_dir: Callable[[str], Path]) -> None:
    path, prompts = model_dir("tiny-llama"), _prompts(2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    config = dict(page_size=page_size, max_extend_tokens=32)
    torch_llm = make_llm(path, attention_backend="torch", **config)
    ref = [r["token_ids"] for r in torch_llm.generate(prompts, params)]
    torch_llm.shutdown()
    for name in ("fa", "fa,fi"):  # the pair Hopper GPUs use: FA3 prefill, FlashInfer decode
        fake_sgl_kernel.calls.clear()
        llm = make_llm(path, attention_backend=name, **config)
        assert [o["token_ids"] for o in llm.generate(prompts, params)] == ref, name
        layers = llm.engine.local_config.num_layers
        batches = llm.stats.prefill_batches + (llm.stats.decode_batches if name == "fa" else 0)
        assert len(fake_sgl_kernel.calls) == batches * layers, name
        assert all(c["causal"] and c["scale"] == llm.engine.local_config.head_dim**-0.5
                   for c in fake_sgl_kernel.calls)
        llm.shutdown()


def test_the_shell_with_the_hopper_pair(model_dir: Callable[[str], Path],
                                        tmp_path: Path) -> None:
    """`python -m minisgl --shell --attn fa,fi`, both fakes on the path of every process."""
    env = dict(os.environ, TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", str(model_dir("tiny-qwen3")), "--shell",
         "--attn", "fa,fi", "--max-seq-len-override", "64"], input="hello\n/exit\n",
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    ready, answer = out.stdout.split("\n", 1)
    assert "is ready" in ready and len(answer.strip()) > 0
