"""Chapter 2: reference kernels against float64, BaseOP state dicts, the layered model vs HF."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import Batch, Context, Req, SamplingParams, get_global_ctx
from minisgl.kernel import (
    apply_rope,
    embedding,
    fused_add_rms_norm,
    rms_norm,
    rope_cos_sin,
    silu_and_mul,
)
from minisgl.layers import (
    BaseOP,
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearReplicated,
    LinearRowParallel,
    OPList,
    ParallelLMHead,
    RMSNorm,
    RMSNormFused,
    RotaryEmbedding,
    StateLessOP,
    VocabParallelEmbedding,
)

from conftest import chapter_module
from helpers import global_ctx
from reference import assert_aligned, hf_greedy, hf_tokenizer

PROMPTS = ["The capital of France is", "Hello", "Once upon a time, in a small village by the sea,"]
STEPS = 16
# max |ours - float64| allowed, relative to the size of the values, per input dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def skeleton() -> ModuleType:
    return chapter_module("ch02_layers", "skeleton")


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """ours (any dtype) against a float64 reference, within TOL[dtype] of the values' scale."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float((ours.double() - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    assert err <= TOL[dtype] * scale, f"max error {err:.2e} > {TOL[dtype] * scale:.2e} ({dtype})"


def make_req(n: int, cached: int = 0, uid: int = 0) -> Req:
    return Req(torch.arange(n, dtype=torch.int32), uid, cached, 4, uid, SamplingParams())


@pytest.fixture
def ctx() -> Iterator[Context]:
    """A fresh global Context for one test, always removed again."""
    with global_ctx(page_size=1) as context:
        yield context


# ----------------------------------------------------------------------------- kernels

# float64 references written with plain torch, independent of minisgl.kernel


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x, w = x.double(), w.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_rope(x: torch.Tensor, pos: torch.Tensor, heads: int, theta: float) -> torch.Tensor:
    """(x[j], x[j + D/2]) as one complex number, turned by pos * theta^(-2j/D); x is [T, H*D]."""
    x = x.double().view(x.shape[0], heads, -1)
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angle = pos.double()[:, None] * freq[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    return torch.cat([z.real, z.imag], -1).flatten(1)


def cos_sin_table(max_pos: int, d: int, theta: float) -> torch.Tensor:
    """The kernel's input format: [max_pos, D] float32, cos in the first half, sin in the second."""
    angle = torch.arange(max_pos, dtype=torch.float64)[:, None] * theta ** (
        -torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)[None, :]
    return torch.cat([angle.cos(), angle.sin()], -1).float()


SHAPES = [(5, 64), (3, 4, 32), (1, 128), (17, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_against_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    close(out, ref_rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_against_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7 + sum(shape))
    x, r = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    s64 = x.double() + r.double()
    normed, residual = fused_add_rms_norm(x, r, w, 1e-5)
    close(residual, s64, dtype)  # the new residual is x + r
    close(normed, ref_rms_norm(s64, w, 1e-5), dtype)  # normalised after the add


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 9),
    hkv=st.integers(1, 4),
    group=st.integers(1, 4),
    half=st.sampled_from([2, 8, 16, 32]),
    theta=st.sampled_from([10000.0, 1e6]),
    seed=st.integers(0, 2**16),
)
def test_apply_rope_against_complex_rotation(t: int, hkv: int, group: int, half: int,
                                             theta: float, seed: int) -> None:
    d, hq, max_pos = 2 * half, hkv * group, 512
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, max_pos, (t,), generator=g)  # any order, repeats allowed
    q, k = torch.randn(t, hq * d, generator=g), torch.randn(t, hkv * d, generator=g)
    rq, rk = apply_rope(pos, q, k, cos_sin_table(max_pos, d, theta))
    assert rq.shape == q.shape and rk.shape == k.shape
    close(rq, ref_rope(q, pos, hq, theta), torch.float32)
    close(rk, ref_rope(k, pos, hkv, theta), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_rope_low_precision(dtype: torch.dtype) -> None:
    t, hq, hkv, d, theta = 6, 8, 2, 64, 10000.0
    g = torch.Generator().manual_seed(3)
    pos = torch.tensor([0, 1, 2, 100, 511, 37])
    q = torch.randn(t, hq * d, generator=g).to(dtype)
    k = torch.randn(t, hkv * d, generator=g).to(dtype)
    rq, rk = apply_rope(pos, q, k, cos_sin_table(512, d, theta))
    assert rq.dtype == dtype and rk.dtype == dtype
    close(rq, ref_rope(q, pos, hq, theta), dtype)
    close(rk, ref_rope(k, pos, hkv, theta), dtype)


def test_apply_rope_position_zero_is_identity_and_norms_are_kept() -> None:
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(3, 2 * 16, generator=g), torch.randn(3, 16, generator=g)
    rq, rk = apply_rope(torch.zeros(3, dtype=torch.long), q, k, cos_sin_table(8, 16, 1e4))
    assert torch.allclose(rq, q) and torch.allclose(rk, k)
    rq, _ = apply_rope(torch.tensor([1, 5, 7]), q, k, cos_sin_table(8, 16, 1e4))
    assert not torch.allclose(rq, q)
    # a rotation keeps each (j, j + D/2) pair's length: [T, H, 2, D/2] summed over the halves
    assert torch.allclose(rq.view(3, 2, 2, 8).pow(2).sum(2), q.view(3, 2, 2, 8).pow(2).sum(2),
                          atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 32), (2, 3, 16), (1, 256)])
def test_silu_and_mul_against_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    half = shape[-1] // 2
    a, b = x.double()[..., :half], x.double()[..., half:]
    ref = a * (1.0 / (1.0 + torch.exp(-a))) * b  # x * sigmoid(x), written out
    out = silu_and_mul(x)
    assert out.dtype == dtype
    close(out, ref, dtype)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ids_shape", [(7,), (2, 5), (1,)])
def test_embedding_lookup(ids_shape: tuple[int, ...], id_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    vocab, hidden = 50, 12
    weight = torch.randn(vocab, hidden, generator=g)
    ids = torch.randint(0, vocab, ids_shape, generator=g).to(id_dtype)
    # one-hot rows times the table: row i of the result is row ids[i] of the table
    ref = torch.nn.functional.one_hot(ids.long(), vocab).double() @ weight.double()
    out = embedding(ids, weight)
    assert out.shape == (*ids_shape, hidden)
    close(out, ref, torch.float32)


# ----------------------------------------------------------------------------- BaseOP


class Leaf(BaseOP):
    def __init__(self, n: int) -> None:
        self.weight = torch.zeros(n, 2)
        self.bias = None  # not a tensor: skipped
        self.eps = 1e-6  # not a tensor: skipped
        self._scratch = torch.zeros(3)  # private: not a weight


class Attn(BaseOP):
    def __init__(self) -> None:
        self.qkv_proj = Leaf(4)
        self.o_proj = Leaf(2)
        self._shared = Leaf(9)  # private sub-operator: not walked


class Layer(BaseOP):
    def __init__(self) -> None:
        self.self_attn = Attn()
        self.norm = torch.ones(2)


class Net(BaseOP):
    def __init__(self) -> None:
        self.layers = OPList([Layer(), Layer()])
        self.head = Leaf(5)
        self.rope = RotaryEmbedding(8, 16, 1e4)  # stateless: contributes nothing


NET_KEYS = {
    "layers.0.self_attn.qkv_proj.weight": (4, 2),
    "layers.0.self_attn.o_proj.weight": (2, 2),
    "layers.0.norm": (2,),
    "layers.1.self_attn.qkv_proj.weight": (4, 2),
    "layers.1.self_attn.o_proj.weight": (2, 2),
    "layers.1.norm": (2,),
    "head.weight": (5, 2),
}


def fresh_weights() -> dict[str, torch.Tensor]:
    return {k: torch.randn(shape) for k, shape in NET_KEYS.items()}


def test_state_dict_names_are_recursive() -> None:
    net = Net()
    sd = net.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == NET_KEYS
    assert sd["layers.1.self_attn.o_proj.weight"] is net.layers.op_list[1].self_attn.o_proj.weight
    assert not any("_scratch" in k or "_shared" in k for k in sd)  # nothing private
    assert net.layers.op_list[0].state_dict(prefix="x") == {
        "x.self_attn.qkv_proj.weight": net.layers.op_list[0].self_attn.qkv_proj.weight,
        "x.self_attn.o_proj.weight": net.layers.op_list[0].self_attn.o_proj.weight,
        "x.norm": net.layers.op_list[0].norm,
    }


def test_load_state_dict_replaces_tensors_and_pops_keys() -> None:
    net, weights = Net(), fresh_weights()
    expected = dict(weights)
    net.load_state_dict(weights)
    assert weights == {}  # every key consumed
    for key, tensor in net.state_dict().items():
        assert tensor is expected[key]  # the very tensor given, not a copy into the old one


def test_load_state_dict_names_the_missing_key() -> None:
    weights = fresh_weights()
    del weights["layers.1.self_attn.o_proj.weight"]
    with pytest.raises(KeyError, match=r"layers\.1\.self_attn\.o_proj\.weight"):
        Net().load_state_dict(weights)


def test_load_state_dict_names_a_shape_mismatch() -> None:
    weights = fresh_weights()
    weights["layers.0.self_attn.qkv_proj.weight"] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight: expected \(4, 2\).*got \(4, 3\)"):
        Net().load_state_dict(weights)


def test_load_state_dict_refuses_a_dtype_mismatch() -> None:
    weights = fresh_weights()
    weights["head.weight"] = weights["head.weight"].double()
    with pytest.raises(ValueError, match=r"head\.weight"):
        Net().load_state_dict(weights)


def test_load_state_dict_names_leftover_keys() -> None:
    weights = fresh_weights()
    weights["layers.2.norm"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"layers\.2\.norm"):
        Net().load_state_dict(weights)
    with pytest.raises(ValueError, match="extra"):  # OPList on its own, too
        OPList([Leaf(1)]).load_state_dict({"0.weight": torch.zeros(1, 2), "extra": torch.ones(1)})


def test_stateless_op_has_no_weights() -> None:
    class Table(StateLessOP):
        def __init__(self) -> None:
            self.table = torch.ones(4)  # public, but a stateless op holds no weights

    assert Table().state_dict() == {}
    assert RotaryEmbedding(8, 16, 1e4).state_dict() == {}
    Table().load_state_dict({})
    with pytest.raises(ValueError, match="table"):
        Table().load_state_dict({"table": torch.ones(4)})


# ----------------------------------------------------------------------------- layers


def test_linear_family_shapes_and_math() -> None:
    hidden, d, hq, hkv = 64, 16, 4, 2
    qkv = LinearQKVMerged(hidden, d, hq, hkv)
    assert qkv.weight.shape == ((hq + 2 * hkv) * d, hidden) and qkv.bias is None
    assert set(qkv.state_dict()) == {"weight"}
    qkv_b = LinearQKVMerged(hidden, d, hq, hkv, has_bias=True)
    assert qkv_b.bias is not None and qkv_b.bias.shape == ((hq + 2 * hkv) * d,)
    assert set(qkv_b.state_dict()) == {"weight", "bias"}
    assert LinearColParallelMerged(hidden, [128, 128]).weight.shape == (256, hidden)
    assert LinearColParallelMerged(hidden, [10, 20, 30]).weight.shape == (60, hidden)
    assert LinearOProj(hq * d, hidden).weight.shape == (hidden, hq * d)
    assert LinearRowParallel(128, hidden).weight.shape == (hidden, 128)
    assert LinearReplicated(hidden, 7, True).weight.shape == (7, hidden)

    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(*qkv_b.weight.shape, generator=g), torch.randn(128, generator=g)
    qkv_b.load_state_dict({"weight": w, "bias": b})
    x = torch.randn(5, hidden, generator=g)
    close(qkv_b.forward(x), x.double() @ w.double().T + b.double(), torch.float32)


def test_rms_norm_layers() -> None:
    g = torch.Generator().manual_seed(4)
    x, r, w = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g), torch.rand(32)
    norm, fused = RMSNorm(32, 1e-6), RMSNormFused(32, 1e-6)
    norm.load_state_dict({"weight": w})
    fused.load_state_dict({"weight": w.clone()})
    close(norm.forward(x), ref_rms_norm(x, w, 1e-6), torch.float32)
    normed, residual = fused.forward(x, None)  # first layer: the input becomes the residual
    close(normed, ref_rms_norm(x, w, 1e-6), torch.float32)
    assert torch.equal(residual, x)
    normed, residual = fused.forward(x, r)
    close(residual, x.double() + r.double(), torch.float32)
    close(normed, ref_rms_norm(x.double() + r.double(), w, 1e-6), torch.float32)


def test_rotary_embedding_builds_its_table_on_cpu_under_meta() -> None:
    d, hq, hkv, theta = 32, 4, 2, 1e6
    with torch.device("meta"):
        rotary = RotaryEmbedding(d, 1024, theta)
        assert torch.empty(1).is_meta  # the model's weights would be meta here
    assert rotary._cos_sin_cache.device.type == "cpu"
    g = torch.Generator().manual_seed(9)
    pos = torch.tensor([0, 3, 1023, 17, 17])
    q, k = torch.randn(5, hq * d, generator=g), torch.randn(5, hkv * d, generator=g)
    rq, rk = rotary.forward(pos, q, k)
    close(rq, ref_rope(q, pos, hq, theta), torch.float32)
    close(rk, ref_rope(k, pos, hkv, theta), torch.float32)


def test_rotary_looks_the_table_up_once_per_positions_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import minisgl.layers.rotary as rotary_module

    calls: list[torch.Tensor] = []

    def counting(positions: torch.Tensor, *rest: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(positions)
        return rope_cos_sin(positions, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(rotary_module, "rope_cos_sin", counting)
    d, hq, hkv, theta = 16, 2, 1, 1e4
    rotary = RotaryEmbedding(d, 64, theta)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, hq * d, generator=g), torch.randn(3, hkv * d, generator=g)
    pos = torch.tensor([1, 2, 3])
    for _ in range(4):  # four layers of one forward pass share the batch's positions
        rq, _ = rotary.forward(pos, q, k)
    assert len(calls) == 1
    close(rq, ref_rope(q, pos, hq, theta), torch.float32)
    later = torch.tensor([9, 0, 63])  # the next batch brings a new tensor: looked up again
    rq, rk = rotary.forward(later, q, k)
    assert len(calls) == 2
    close(rq, ref_rope(q, later, hq, theta), torch.float32)
    close(rk, ref_rope(k, later, hkv, theta), torch.float32)


def test_embedding_layer_and_tied_head_share_the_table(ctx: Context) -> None:
    vocab, hidden = 40, 8
    emb = VocabParallelEmbedding(vocab, hidden)
    head = ParallelLMHead(vocab, hidden, emb)
    assert head.state_dict() == {}  # no weight of its own
    table = torch.randn(vocab, hidden)
    emb.load_state_dict({"weight": table})  # loaded after the head was made
    ids = torch.tensor([3, 39, 0], dtype=torch.int32)
    x = emb.forward(ids)
    assert torch.equal(x, table[ids.long()])
    batch = Batch([make_req(1, uid=i) for i in range(3)], "decode")
    with ctx.forward_batch(batch):
        logits = head.forward(x)
    close(logits, x.double() @ table.double().T, torch.float32)


def test_untied_head_owns_its_weight(ctx: Context) -> None:
    head = ParallelLMHead(10, 4)
    assert set(head.state_dict()) == {"weight"}
    w = torch.randn(10, 4)
    head.load_state_dict({"weight": w})
    x = torch.randn(2, 4)
    with ctx.forward_batch(Batch([make_req(1, uid=0), make_req(1, uid=1)], "decode")):
        close(head.forward(x), x.double() @ w.double().T, torch.float32)


def test_lm_head_keeps_the_last_token_of_each_request_in_prefill(ctx: Context) -> None:
    head = ParallelLMHead(10, 4)
    w = torch.randn(10, 4)
    head.load_state_dict({"weight": w})
    # extend lengths 3, 1 and 4 (the last one with 2 tokens already cached)
    reqs = [make_req(3, uid=0), make_req(1, uid=1), make_req(6, cached=2, uid=2)]
    x = torch.randn(8, 4)
    with ctx.forward_batch(Batch(reqs, "prefill")):
        logits = head.forward(x)
    assert logits.shape == (3, 10)
    close(logits, x[[2, 3, 7]].double() @ w.double().T, torch.float32)


def test_lm_head_needs_a_running_batch(ctx: Context) -> None:
    head = ParallelLMHead(10, 4)
    with pytest.raises(RuntimeError, match="forward_batch"):
        head.forward(torch.randn(2, 4))


# ----------------------------------------------------------------------------- end to end


def drive(model: BaseOP, prompts: list[list[int]]) -> tuple[list[list[int]],
                                                             list[list[torch.Tensor]]]:
    """The skeleton's generate() loop, driven here to keep every step's logits."""
    sk, ctx = skeleton(), get_global_ctx()
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    reqs = [Req(torch.tensor(p, dtype=torch.int32), i, 0, STEPS, i, params)
            for i, p in enumerate(prompts)]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(STEPS):
        batch = sk.make_batch(reqs, "prefill" if step == 0 else "decode")
        with ctx.forward_batch(batch), torch.no_grad():
            out = model.forward()
        assert out.shape == (len(reqs), logits_width(model))
        for req, row, log in zip(reqs, out, logits):
            log.append(row.float())
            req.complete_one()
            req.append_host(row.argmax())
    return [r.input_ids[len(p):].tolist() for r, p in zip(reqs, prompts)], logits


def logits_width(model: BaseOP) -> int:
    return model.model.embed_tokens.weight.shape[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "tied"),
                         [("tiny-qwen3", True), ("tiny-llama", False), ("tiny-qwen2", False)])
def test_layered_model_matches_hf(ctx: Context, model_dir, name: str, tied: bool) -> None:
    path = model_dir(name)
    model = skeleton().LayeredModel(path)
    names = model.state_dict()
    assert ("lm_head.weight" in names) is not tied
    assert "model.layers.1.self_attn.qkv_proj.weight" in names
    assert ("model.layers.0.self_attn.qkv_proj.bias" in names) is (name == "tiny-qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) is (name == "tiny-qwen3")
    tok = hf_tokenizer(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    tokens, logits = drive(model, prompts)
    for prompt, ours, our_logits in zip(prompts, tokens, logits):
        assert_aligned(ours, our_logits, *hf_greedy(path, prompt, STEPS))
    # the skeleton's own generate() on a fresh model gives the same tokens
    assert skeleton().generate(skeleton().LayeredModel(path), prompts, STEPS) == tokens
