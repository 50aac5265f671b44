"""Chapter 4: the paged KV pool, store_kv, page-aligned slots, and HF alignment through the pool."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import Req, get_global_ctx
from minisgl.kvcache import BaseKVCachePool, MHAKVCache, create_kvcache_pool
from minisgl.models import ModelConfig

from conftest import chapter_module
from helpers import Recorder, global_ctx, hf_reference
from reference import assert_aligned, hf_tokenizer

skeleton = chapter_module("ch04_kvpool", "skeleton")

TINY = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def small_config(layers: int = 3, kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, "hidden_size": 32,
        "intermediate_size": 64, "vocab_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128,
    })


# --- the pool ---------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_buffer_shape_and_flat_views(page_size: int) -> None:
    config = small_config(layers=3, kv_heads=2, head_dim=8)
    pool = create_kvcache_pool(config, 5, page_size, torch.device("cpu"), torch.float32)
    assert isinstance(pool, MHAKVCache) and isinstance(pool, BaseKVCachePool)
    assert tuple(pool._buffer.shape) == (2, 3, 5, page_size, 2, 8)
    assert pool.num_layers == 3 and pool.dtype == torch.float32
    assert pool.device == torch.device("cpu")
    slots = 5 * page_size
    pool._buffer.zero_()
    for layer in range(3):
        k, v = pool.k_cache(layer), pool.v_cache(layer)
        assert tuple(k.shape) == tuple(v.shape) == (slots, 2, 8)
        # writing through the flat view lands at (page, offset) of the same layer in the buffer
        slot = slots - 1 - layer
        k[slot] = 1.0 + layer
        v[slot] = -1.0 - layer
        page, off = divmod(slot, page_size)
        assert torch.all(pool._buffer[0, layer, page, off] == 1.0 + layer)
        assert torch.all(pool._buffer[1, layer, page, off] == -1.0 - layer)
        # and writing into the buffer is visible through the view
        pool._buffer[1, layer, 0, 0, 1, 3] = 7.0
        assert pool.v_cache(layer)[0, 1, 3] == 7.0
    assert int((pool._buffer != 0).sum()) == 3 * (2 * 2 * 8 + 1)  # nothing else was touched


def test_pool_dtype_is_honoured() -> None:
    pool = create_kvcache_pool(small_config(), 2, 4, torch.device("cpu"), torch.bfloat16)
    assert pool.dtype == torch.bfloat16 == pool.k_cache(0).dtype == pool.v_cache(2).dtype


@settings(max_examples=80, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(1, 6),
       layer=st.integers(0, 2), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_store_kv_writes_exactly_out_loc(data: st.DataObject, page_size: int, num_pages: int,
                                         layer: int, index_dtype: torch.dtype) -> None:
    pool = create_kvcache_pool(small_config(layers=3, kv_heads=2, head_dim=4), num_pages,
                               page_size, torch.device("cpu"), torch.float32)
    assert isinstance(pool, MHAKVCache)
    slots = num_pages * page_size
    order = data.draw(st.permutations(list(range(slots))))
    out_loc = order[: data.draw(st.integers(0, slots))]
    pool._buffer.copy_(torch.randn(pool._buffer.shape))
    before = pool._buffer.clone()
    k, v = torch.randn(len(out_loc), 2, 4), torch.randn(len(out_loc), 2, 4)
    pool.store_kv(k, v, torch.tensor(out_loc, dtype=index_dtype), layer)
    expected = before.clone()
    for i, slot in enumerate(out_loc):  # independent reference: one token at a time
        page, off = divmod(slot, page_size)
        expected[0, layer, page, off] = k[i]
        expected[1, layer, page, off] = v[i]
    assert torch.equal(pool._buffer, expected)


# --- slots and the page table -----------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 4]),
       steps=st.lists(st.tuples(st.booleans(), st.integers(1, 9)), min_size=1, max_size=40),
       seed=st.integers(0, 2**16))
def test_place_gives_page_aligned_slots(page_size: int, steps: list[tuple[bool, int]],
                                        seed: int) -> None:
    """Random interleavings of new requests (prefill) and decode steps of live ones."""
    num_pages, rows = 200, 4
    with global_ctx(page_size) as ctx:
        batcher = skeleton.PagedBatcher(small_config(), num_pages=num_pages, page_size=page_size,
                                        max_running_req=rows, max_seq_len=64)
        assert tuple(ctx.kv_cache._buffer.shape) == (2, 3, num_pages + 1, page_size, 2, 8)
        assert tuple(ctx.page_table.shape) == (rows + 1, 64)
        random.Random(seed).shuffle(batcher.free_pages)  # slots need not follow page order
        live: list[Req] = []
        placed: dict[int, list[int]] = {}  # uid -> slot of each of its positions so far
        for add, n in steps:
            prefill = add and bool(batcher.free_rows)
            if prefill:
                req = batcher.add(len(placed), list(range(1, n + 1)), max_tokens=32)
                live.append(req)
                placed[req.uid] = []
            elif live:
                req = live[n % len(live)]
                if not req.can_decode:
                    continue
                req.complete_one()
                req.append_host(torch.tensor(5))
            else:
                continue
            assert req.extend_len == (n if prefill else 1)
            slots = batcher.place(req).tolist()
            placed[req.uid] += slots
            check_placement(batcher, live, placed, num_pages)


def check_placement(batcher: Any, live: list[Req], placed: dict[int, list[int]],
                    num_pages: int) -> None:
    ps, table = batcher.page_size, get_global_ctx().page_table
    owned: list[int] = []
    for req in live:
        slots, pages = placed[req.uid], batcher.pages[req.uid]
        assert len(slots) == req.device_len
        assert len(pages) == -(-req.device_len // ps)  # a new page only at a page boundary
        for pos, slot in enumerate(slots):
            assert slot // ps == pages[pos // ps] and slot % ps == pos % ps, (pos, slot)
        assert table[req.table_idx, : req.device_len].tolist() == slots
        owned += pages
    assert len(set(owned)) == len(owned), "a page belongs to two live requests"
    all_slots = [s for req in live for s in placed[req.uid]]
    assert len(set(all_slots)) == len(all_slots), "a slot belongs to two live requests"
    assert not set(owned) & set(batcher.free_pages)
    assert sorted(owned + batcher.free_pages) == list(range(num_pages))  # never the padding page
    rows = [req.table_idx for req in live]
    assert len(set(rows)) == len(rows) and not set(rows) & set(batcher.free_rows)
    assert sorted(rows + batcher.free_rows) == list(range(len(table) - 1))  # never the dummy row


# --- end to end -------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", TINY)
def test_paged_generation_equals_hf(name: str, page_size: int, model_dir) -> None:
    """Two prompts in one batch, pages handed out in a scrambled order: K/V go into the pool
    and come back through the page table; tokens and logits equal HF at every step."""
    path = model_dir(name)
    prompts = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS]
    num_pages, rows = 48 // page_size, 3
    with global_ctx(page_size) as ctx:
        model, config = skeleton.load_model(path)
        batcher = skeleton.PagedBatcher(config, num_pages=num_pages, page_size=page_size,
                                        max_running_req=rows, max_seq_len=64)
        pool = ctx.kv_cache
        assert isinstance(pool, MHAKVCache)
        assert tuple(pool._buffer.shape) == (2, config.num_layers, num_pages + 1, page_size,
                                             config.num_kv_heads, config.head_dim)
        random.Random(page_size).shuffle(batcher.free_pages)
        pool._buffer.fill_(float("nan"))  # a slot read before it is written poisons the logits
        recorder = Recorder(model)
        tokens = batcher.generate(recorder, prompts, max_tokens=16)
        for i, (ids, ours) in enumerate(zip(prompts, tokens)):
            seen = [x[i] for x in recorder.logits]
            assert_aligned(ours, seen, *hf_reference(path, tuple(ids)))
        # rows and pages come back after generate
        assert sorted(batcher.free_rows) == list(range(rows)) and not batcher.pages
        assert sorted(batcher.free_pages) == list(range(num_pages))
        # request 1's K of layer 0 sit in the slots its table row lists, page-aligned
        slots = ctx.page_table[1, : len(prompts[1]) + 15].long()
        assert not torch.isnan(pool.k_cache(0)[slots]).any()
        assert torch.equal(slots % page_size, torch.arange(len(slots)) % page_size)
