"""Chapter 11: the overlap loop, and the stage-2 milestone: the same greedy tokens as HF
across overlap on/off, radix/naive, chunk budget, page size and max_running_req; a shared
prefix computed once (at most a quarter of naive's prefill tokens, counted by the scheduler)."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.utils import device as device_utils

from reference import hf_greedy

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
BASE = {"overlap": True, "cache_type": "radix", "max_extend_tokens": 8192, "page_size": 1,
        "max_running_req": 16}
CONFIGS = [
    {},
    {"overlap": False},
    {"cache_type": "naive"},
    {"max_extend_tokens": 8},
    {"page_size": 4},
    {"max_running_req": 2},
    {"overlap": False, "cache_type": "naive", "max_extend_tokens": 8, "page_size": 4,
     "max_running_req": 2},
    {"max_extend_tokens": 8, "page_size": 4, "max_running_req": 2},
]


@cache
def shared_prefix_prompts(n: int = 8, prefix_len: int = 96, suffix_len: int = 8,
                          ) -> list[list[int]]:
    """n prompts: one random prefix, then a distinct random suffix each."""
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (suffix_len + i % 3,), generator=g).tolist()
            for i in range(n)]


@pytest.mark.parametrize("change", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in
                                                                  c.items()) or "base")
def test_every_configuration_gives_hf_tokens(change: dict, model_dir, make_llm) -> None:
    path = model_dir("tiny-qwen3")
    prompts = shared_prefix_prompts()
    llm = make_llm(path, **{**BASE, **change})
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    assert out == [hf_greedy(path, p, 10)[0] for p in prompts]


@pytest.mark.parametrize(("name", "page_size"), [("tiny-llama", 1), ("tiny-qwen2", 4),
                                               ("tiny-mistral", 1)])
def test_shared_prefix_costs_a_quarter(name: str, page_size: int, model_dir, make_llm) -> None:
    path = model_dir(name)
    prompts = shared_prefix_prompts()
    computed = {}
    for cache_type in ("radix", "naive"):
        llm = make_llm(path, overlap=True, cache_type=cache_type, page_size=page_size)
        llm.generate(prompts, GREEDY)
        computed[cache_type] = llm.stats.prefill_tokens
        llm.shutdown()
    assert computed["naive"] == sum(map(len, prompts))
    assert computed["radix"] * 4 <= computed["naive"], computed


def test_overlap_launches_the_next_batch_before_processing(model_dir, make_llm) -> None:
    """The order of events while the device is still computing (a copy event that never says
    it is done): launch 1, launch 2, process 1, launch 3, ..."""
    path = model_dir("tiny-qwen3")
    events: list[str] = []
    for overlap in (True, False):
        llm = make_llm(path, overlap=overlap)
        forward, process = llm._forward, llm._process_last_data

        def spy_forward(fi, forward=forward):
            events.append("launch")
            busy = SimpleNamespace(query=lambda: False, synchronize=lambda: None)
            return forward(fi)._replace(copy_done=busy)

        def spy_process(data, process=process):
            if data is not None:
                events.append("process")
            return process(data)

        llm._forward, llm._process_last_data = spy_forward, spy_process  # type: ignore
        llm.generate(shared_prefix_prompts(2), SamplingParams(max_tokens=3, ignore_eos=True))
        llm.shutdown()
        n = 4  # 2 prefill batches (the second request waits for the first's prefix), 2 decodes
        if overlap:
            assert events == ["launch", "launch", "process", "launch", "process", "launch",
                              "process", "process"]
        else:
            assert events == ["launch", "process"] * n
        events.clear()


def test_eos_under_overlap_is_reported_and_freed_once(model_dir, make_llm) -> None:
    """A request that stops at EOS was already scheduled into the next batch: its extra token
    is not reported and its row and pages are not freed twice."""
    path = model_dir("tiny-qwen3")
    prompts = shared_prefix_prompts(4, 20, 6)
    refs = [hf_greedy(path, p, 10)[0] for p in prompts]
    results = []
    for overlap in (True, False):
        llm = make_llm(path, overlap=overlap)
        llm.eos_token_id = refs[0][4]  # request 0 stops after 4 tokens (others maybe too)
        out = llm.generate(prompts, SamplingParams(max_tokens=10))
        results.append([o["token_ids"] for o in out])
        assert llm.table_manager.available_size == llm.config.max_running_req  # all rows back
        llm.shutdown()  # generate() already checked that every page is free or cached
    assert results[0] == results[1]
    for out, ref, eos in zip(results[0], refs, [refs[0][4]] * 4):
        assert out == (ref[: ref.index(eos)] if eos in ref else ref)


def test_device_abstraction_is_a_no_op_on_cpu() -> None:
    cpu = torch.device("cpu")
    stream = device_utils.create_stream(cpu)
    assert isinstance(stream, device_utils.NullStream)
    with device_utils.stream_context(stream):
        device_utils.set_current_stream(stream)
        stream.wait_stream(stream)
    assert device_utils.create_event(cpu).query() and not device_utils.pin_memory(cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_float32_equals_hf(overlap: bool, model_dir, make_llm) -> None:
    """On a GPU: real streams, events and pinned memory; float32 greedy equals HF (CPU)."""
    path = model_dir("tiny-qwen3")
    prompts = shared_prefix_prompts()
    llm = make_llm(path, overlap=overlap, device="cuda", page_size=4)
    assert llm.device.type == "cuda" and isinstance(llm.stream, torch.cuda.Stream)
    out = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    assert out == [hf_greedy(path, p, 10)[0] for p in prompts]
