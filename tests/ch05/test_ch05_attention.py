"""Chapter 5: TorchBackend against float64 attention, its metadata, the registry, AttentionLayer."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.attention import (
    BACKENDS,
    BaseAttnBackend,
    create_attention_backend,
    resolve_backend_name,
)
from minisgl.attention.torch_backend import TorchBackend, TorchMetadata
from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.kvcache import create_kvcache_pool
from minisgl.layers import RotaryEmbedding
from minisgl.layers.attention import AttentionLayer
from minisgl.models import ModelConfig
from minisgl.utils.registry import Registry

from conftest import chapter_module
from helpers import Recorder, global_ctx, hf_reference
from reference import assert_aligned, hf_tokenizer

skeleton = chapter_module("ch05_attention", "skeleton")

TINY = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def small_config(heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 layers: int = 2) -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, "hidden_size": 32,
        "intermediate_size": 64, "vocab_size": 64, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
    })


# --- TorchBackend against an independent float64 attention ------------------------------------

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cached: int) -> torch.Tensor:
    """float64 causal attention of q [n, Hq, D] (positions cached..cached+n-1) over all of a
    request's k, v [cached + n, Hkv, D]; query head h reads kv head h // (Hq / Hkv)."""
    n, hq, d = q.shape
    kv_head = torch.arange(hq) // (hq // k.shape[1])
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for t in range(n):
        seen = cached + t + 1  # a token attends to itself and everything before it
        for h in range(hq):
            keys, values = k[:seen, kv_head[h]].double(), v[:seen, kv_head[h]].double()
            weights = torch.softmax(keys @ q[t, h].double() / d**0.5, dim=0)
            out[t, h] = weights @ values
    return out


def run_backend(spec: list[tuple[int, int]], phase: str, heads: int, kv_heads: int,
                page_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, Batch]:
    """Requests with (cached_len, extend_len) each: their whole K/V sit in layer 1 of a pool
    (pages in random order, everything else NaN), the new tokens' K/V written through out_loc.
    Returns (backend output, float64 reference, batch)."""
    d, gen = 8, torch.Generator().manual_seed(seed)
    config = small_config(heads, kv_heads, d)
    ctx = get_global_ctx()
    num_pages = sum(-(-(c + n) // page_size) for c, n in spec) + 1
    pool = create_kvcache_pool(config, num_pages, page_size, torch.device("cpu"), torch.float32)
    ctx.kv_cache = pool
    ctx.page_table = torch.zeros(len(spec) + 1, 64, dtype=torch.int32)
    backend = create_attention_backend("torch", config)
    ctx.attn_backend = backend
    pool._buffer.fill_(float("nan"))  # type: ignore[attr-defined]
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    reqs, qs, ks, vs, positions, out_loc, refs = [], [], [], [], [], [], []
    for i, (cached, n) in enumerate(spec):
        total = cached + n
        pages = [free.pop() for _ in range(-(-total // page_size))]
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size
                              for p in range(total)])
        ctx.page_table[i, :total] = slots
        k = torch.randn(total, kv_heads, d, generator=gen)
        v = torch.randn(total, kv_heads, d, generator=gen)
        q = torch.randn(n, heads, d, generator=gen)
        pool.store_kv(k[:cached], v[:cached], slots[:cached], 1)  # earlier steps' K/V
        reqs.append(Req(torch.zeros(total, dtype=torch.int32), i, cached, 1, i, SamplingParams()))
        qs.append(q)
        ks.append(k[cached:])
        vs.append(v[cached:])
        positions.append(torch.arange(cached, total))
        out_loc.append(slots[cached:])
        refs.append(reference_attention(q, k, v, cached))
    batch = Batch(reqs, phase)  # type: ignore[arg-type]
    batch.positions, batch.out_loc = torch.cat(positions), torch.cat(out_loc)
    batch.input_ids = torch.zeros_like(batch.positions)
    batch.padded_reqs = reqs
    k_new, v_new = torch.cat(ks), torch.cat(vs)
    pool.store_kv(k_new, v_new, batch.out_loc, 1)  # what AttentionLayer does before forward
    backend.prepare_metadata(batch)
    out = backend.forward(torch.cat(qs), k_new, v_new, 1, batch)
    return out, torch.cat(refs), batch


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (3, 3), (4, 1)])
def test_mixed_prefill_matches_float64(heads: int, kv_heads: int, page_size: int) -> None:
    """One prefill on top of a cached prefix of 5 tokens, two plain prefills."""
    with global_ctx(page_size):
        out, ref, _ = run_backend([(5, 4), (0, 7), (0, 1)], "prefill", heads, kv_heads,
                                  page_size, seed=heads * 10 + kv_heads)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_batch_matches_float64(page_size: int) -> None:
    with global_ctx(page_size):
        out, ref, _ = run_backend([(0, 1), (6, 1), (13, 1), (3, 1)], "decode", 4, 2,
                                  page_size, seed=7)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)


@settings(max_examples=40, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=4),
       decode=st.booleans(), heads=st.sampled_from([(4, 2), (2, 2), (6, 3), (4, 1)]),
       page_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_backend_matches_float64_property(spec: list[tuple[int, int]], decode: bool,
                                          heads: tuple[int, int], page_size: int,
                                          seed: int) -> None:
    if decode:
        spec = [(cached, 1) for cached, _ in spec]
    with global_ctx(page_size):
        out, ref, _ = run_backend(spec, "decode" if decode else "prefill", *heads, page_size,
                                  seed)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)


def test_metadata_reads_the_page_table() -> None:
    """The padded block: slots from the page table (padding repeats a request's first slot),
    a length-and-causal mask, and q / output indices that are each other's inverse."""
    with global_ctx(4) as ctx:
        _, _, batch = run_backend([(5, 4), (0, 7), (2, 1)], "prefill", 4, 2, 4, seed=3)
        meta = batch.attn_metadata
        assert isinstance(meta, TorchMetadata)
        assert meta.kv_slots.shape == (3, 9) and meta.kv_slots.dtype == torch.int64
        for i, total in enumerate([9, 7, 3]):
            row = ctx.page_table[i].long()
            assert torch.equal(meta.kv_slots[i, :total], row[:total])
            assert (meta.kv_slots[i, total:] == row[0]).all()
        # additive, in the cache's dtype: 0 where a query may look, -inf where it may not
        assert meta.mask.dtype == ctx.kv_cache.k_cache(0).dtype
        assert set(meta.mask.unique().tolist()) == {0.0, float("-inf")}
        allowed = meta.mask == 0
        assert allowed.shape == (3, 1, 2 * 7, 9)  # rows (h, j): 2 q heads per kv head x 7
        assert torch.equal(allowed[:, :, :7], allowed[:, :, 7:])  # both heads see the same
        # request 0: query j sits at position 5 + j and sees keys 0..5+j
        assert allowed[0, 0, 0].tolist() == [True] * 6 + [False] * 3
        assert allowed[0, 0, 3].tolist() == [True] * 9
        # request 2 (cached 2, one new token): its one real query sees its 3 keys, not more
        assert allowed[2, 0, 0].tolist() == [True] * 3 + [False] * 6
        assert meta.q_index is not None and meta.out_index is not None
        assert meta.q_index[1].tolist() == list(range(4, 11))
        flat = torch.arange(12)
        assert torch.equal(flat[meta.q_index].reshape(-1)[meta.out_index], flat)


def test_decode_metadata_needs_no_q_index() -> None:
    with global_ctx(1):
        _, _, batch = run_backend([(0, 1), (6, 1), (3, 1)], "decode", 4, 2, 1, seed=5)
        meta = batch.attn_metadata
        assert isinstance(meta, TorchMetadata)
        assert meta.q_index is None and meta.out_index is None
        assert meta.mask.shape == (3, 1, 1, 7)
        assert (meta.mask[:, 0, 0] == 0).sum(-1).tolist() == [1, 7, 4]


# --- registry and interface -------------------------------------------------------------------

def test_registry_creates_torch_backend() -> None:
    assert "torch" in BACKENDS.names()
    backend = create_attention_backend("torch", small_config())
    assert isinstance(backend, TorchBackend) and isinstance(backend, BaseAttnBackend)
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert resolve_backend_name("torch", torch.device("cpu")) == "torch"


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(KeyError, match="nonexistent") as err:
        create_attention_backend("nonexistent", small_config())
    for name in BACKENDS.names():
        assert name in str(err.value)


def test_registering_a_name_twice_fails() -> None:
    factory = BACKENDS["torch"]
    with pytest.raises(KeyError, match="twice"):
        BACKENDS.register("torch")(lambda config: None)
    assert BACKENDS["torch"] is factory
    registry: Registry[int] = Registry("number")
    assert registry.register("one")(1) == 1
    with pytest.raises(KeyError, match="one"):
        registry.register("one")
    assert registry["one"] == 1 and registry.names() == ["one"]
    with pytest.raises(KeyError, match="number 'two'.*one"):
        registry["two"]


def test_graph_hooks_are_not_implemented_unless_a_backend_adds_them() -> None:
    """The base class refuses capture; the torch backend brings its hooks in chapter 18."""
    class NoGraphs(BaseAttnBackend):
        def prepare_metadata(self, batch: Any) -> None:
            pass

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    batch: Any) -> torch.Tensor:
            return q

    backend = NoGraphs()
    with global_ctx(1):
        _, _, batch = run_backend([(0, 2)], "prefill", 4, 2, 1, seed=0)
    with pytest.raises(NotImplementedError):
        backend.init_capture_graph(64, [1, 2, 4])
    with pytest.raises(NotImplementedError):
        backend.prepare_for_capture(batch)
    with pytest.raises(NotImplementedError):
        backend.prepare_for_replay(batch)
    assert not backend.supports_graphs
    assert create_attention_backend("torch", small_config()).supports_graphs


def rope_reference(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """(x[j], x[j + D/2]) as a complex number turned by pos * theta^(-2j/D), in float64."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    z = z * torch.polar(torch.ones_like(freq), pos[:, None].double() * freq)[:, None, :]
    return torch.cat([z.real, z.imag], -1)


class SpyBackend(BaseAttnBackend):
    """Looks into the pool when called: what is stored at out_loc at that moment."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def prepare_metadata(self, batch: Batch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        pool = get_global_ctx().kv_cache
        loc = batch.out_loc
        self.calls.append((pool.k_cache(layer_id)[loc].clone(), pool.v_cache(layer_id)[loc].clone(),
                           k.clone(), v.clone()))
        return q * 2.0


def test_attention_layer_stores_kv_before_the_backend_reads() -> None:
    hq, hkv, d, theta, layer = 4, 2, 8, 10000.0, 1
    with global_ctx(4) as ctx:
        pool = create_kvcache_pool(small_config(hq, hkv, d), 6, 4, torch.device("cpu"),
                                   torch.float32)
        ctx.kv_cache = pool
        pool._buffer.fill_(float("nan"))  # type: ignore[attr-defined]
        spy = SpyBackend()
        ctx.attn_backend = spy
        attn = AttentionLayer(layer, hq, hkv, d, RotaryEmbedding(d, 256, theta))
        req = Req(torch.zeros(9, dtype=torch.int32), 0, 4, 1, 0, SamplingParams())
        batch = Batch([req], "prefill")
        batch.positions = torch.arange(4, 9)
        batch.out_loc = torch.tensor([21, 22, 23, 8, 9])
        batch.input_ids = torch.zeros(5, dtype=torch.int64)
        batch.padded_reqs = [req]
        qkv = torch.randn(5, (hq + 2 * hkv) * d)
        with ctx.forward_batch(batch):
            out = attn.forward(qkv)
        [(k_stored, v_stored, k_seen, v_seen)] = spy.calls
        q_raw, k_raw, v_raw = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        assert torch.equal(k_stored, k_seen) and torch.equal(v_stored, v_seen)
        assert torch.equal(v_stored, v_raw.reshape(5, hkv, d))  # V is stored as computed
        k_ref = rope_reference(k_raw.reshape(5, hkv, d), batch.positions, theta)
        assert torch.allclose(k_stored.double(), k_ref, atol=1e-5)  # K after RoPE
        q_ref = rope_reference(q_raw.reshape(5, hq, d), batch.positions, theta)
        assert out.shape == (5, hq * d)
        assert torch.allclose(out.double(), 2 * q_ref.reshape(5, hq * d), atol=1e-5)
        # only out_loc was written, in layer 1 only
        written = ~torch.isnan(pool._buffer)  # type: ignore[attr-defined]
        assert int(written.sum()) == 2 * 5 * hkv * d
        assert not written[:, 0].any()


# --- models -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_torch_backend_generation_equals_hf(name: str, model_dir) -> None:
    path = model_dir(name)
    prompts = [hf_tokenizer(path)(p)["input_ids"] for p in PROMPTS]
    with global_ctx(4) as ctx:
        model, config = skeleton.load_model(path)
        batcher = skeleton.PagedBatcher(config, num_pages=24, page_size=4, max_running_req=3,
                                        max_seq_len=64)
        assert isinstance(ctx.attn_backend, TorchBackend)
        random.Random(0).shuffle(batcher.free_pages)
        ctx.kv_cache._buffer.fill_(float("nan"))  # type: ignore[attr-defined]
        recorder = Recorder(model)
        tokens = batcher.generate(recorder, prompts, max_tokens=16)
        for i, (ids, ours) in enumerate(zip(prompts, tokens)):
            assert_aligned(ours, [x[i] for x in recorder.logits], *hf_reference(path, tuple(ids)))


@pytest.mark.parametrize("name", TINY)
def test_prefill_in_two_halves_equals_one_shot(name: str, model_dir) -> None:
    """A request's second half attends to its cached first half, in one batch with a plain
    prefill of another prompt; the logits equal those of one-shot prefills."""
    path = model_dir(name)
    long, short = (hf_tokenizer(path)(p)["input_ids"] for p in reversed(PROMPTS))
    with global_ctx(4) as ctx:
        model, config = skeleton.load_model(path)
        batcher = skeleton.PagedBatcher(config, num_pages=48, page_size=4, max_running_req=5,
                                        max_seq_len=64)

        def prefill(reqs: list[Req]) -> torch.Tensor:
            with ctx.forward_batch(batcher.make_batch(reqs, "prefill")):
                return model.forward()

        whole_long, whole_short = prefill([batcher.add(0, long, 1), batcher.add(1, short, 1)])
        half = len(long) // 2
        half += half % 4 == 0  # not on a page boundary
        two = batcher.add(2, long, 1)
        two.device_len = half
        prefill([two])
        two.cached_len, two.device_len = half, len(long)
        other = batcher.add(3, short, 1)
        halves_long, again_short = prefill([two, other])
        assert batcher.pages[2] and set(batcher.pages[2]).isdisjoint(batcher.pages[0])
    assert torch.allclose(halves_long, whole_long, atol=1e-4, rtol=0)
    assert torch.allclose(again_short, whole_short, atol=1e-4, rtol=0)
    assert int(halves_long.argmax()) == int(whole_long.argmax())
