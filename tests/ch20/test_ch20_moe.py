"""Chapter 20: the MoE backends against an independent float64 MoE (every expert on every
token, weighted by the top-k mask), the alignment step against plain Python, and the triton
backend's behaviour without Triton or without a GPU. The Triton kernel runs in Triton's
interpreter on the CPU (see conftest.py) and compiled where there is CUDA."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minisgl.moe import create_moe_backend, resolve_moe_backend, select_experts
from minisgl.moe.triton_backend import align_block_size, block_sizes

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the dev extra installs it)")


def dense_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  mix: torch.Tensor) -> torch.Tensor:
    """sum over e of mix[t, e] * expert_e(x[t]), every expert on every token, float64 [T, H]."""
    x, gate_up, down, mix = x.double(), gate_up.double(), down.double(), mix.double()
    inter = gate_up.shape[1] // 2
    pre = torch.einsum("th,eih->eti", x, gate_up)  # [E, T, 2I]: gate rows, then up rows
    act = torch.nn.functional.silu(pre[..., :inter]) * pre[..., inter:]
    return torch.einsum("te,eti,ehi->th", mix, act, down)


def dense_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The router in float64: softmax, the top k kept (a mask, no topk call), renormalised."""
    probs = torch.softmax(router_logits.double(), dim=-1)
    kth = probs.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
    mix = probs * (probs >= kth)
    if renormalize:
        mix = mix / mix.sum(dim=-1, keepdim=True)
    return dense_experts(x, gate_up, down, mix)


def random_layer(tokens: int, experts: int = 8, hidden: int = 64, inter: int = 32,
                 seed: int = 0, unused: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """x, gate_up, down, router logits in float32 on DEVICE; no token picks the experts in
    `unused` (their logits sit far below the others)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g) * 2
    logits[:, list(unused)] -= 100.0
    return tuple(t.to(DEVICE) for t in (x, gate_up, down, logits))


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    err = float((got.double().cpu() - ref.cpu()).abs().max())
    assert err <= tol * max(1.0, float(ref.abs().max())), f"max |error| {err:.2e}"


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("renormalize", [True, False])
def test_torch_backend_equals_dense_reference(tokens: int, renormalize: bool) -> None:
    x, gate_up, down, logits = random_layer(tokens, seed=tokens)
    out = create_moe_backend("torch", torch.device(DEVICE)).forward(x, gate_up, down, logits, 2,
                                                                    renormalize)
    assert out.shape == x.shape and out.dtype == torch.float32
    ref = dense_moe(x, gate_up, down, logits, 2, renormalize)
    assert_close(out, ref)
    other = dense_moe(x, gate_up, down, logits, 2, not renormalize)
    assert float((ref - other).abs().max()) > 1e-2  # the comparison can tell the two apart


def test_select_experts_renormalises_the_top_k() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [3, 0]] and weights.dtype == torch.float32
    e = torch.tensor([[2.0, 1.0], [3.5, 3.0]], dtype=torch.float64).exp()
    assert torch.allclose(weights.double(), e / e.sum(-1, keepdim=True), atol=1e-7)
    raw, _ = select_experts(logits, 2, renormalize=False)
    assert torch.allclose(raw.double(), torch.softmax(logits.double(), -1).gather(1, ids),
                          atol=1e-7)


def python_alignment(ids: list[list[int]], block: int, experts: int
                     ) -> tuple[list[int], list[int]]:
    """The expected layout in plain Python: pair p = t * top_k + j; each expert's pairs in
    increasing order, padded with num_pairs to a multiple of block; one expert per block."""
    flat = [e for row in ids for e in row]
    sorted_ids: list[int] = []
    block_expert: list[int] = []
    for e in range(experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        padded = mine + [len(flat)] * (-len(mine) % block)
        sorted_ids += padded
        block_expert += [e] * (len(padded) // block)
    return sorted_ids, block_expert


@pytest.mark.parametrize("tokens,top_k,experts,block,seed", [
    (1, 2, 8, 16, 0), (3, 2, 8, 4, 1), (17, 2, 8, 16, 2), (40, 2, 8, 64, 3), (64, 8, 128, 16, 4),
    (9, 1, 4, 3, 5)])
def test_alignment_against_python(tokens: int, top_k: int, experts: int, block: int,
                                  seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # distinct experts per token, drawn from the lower half only: the upper half gets no pair
    ids = torch.stack([torch.randperm(max(experts // 2, top_k), generator=g)[:top_k]
                       for _ in range(tokens)])
    align = align_block_size(ids.to(DEVICE), block, experts)
    want_ids, want_blocks = python_alignment(ids.tolist(), block, experts)
    used = int(align.num_padded.item())
    capacity = align.sorted_ids.numel()
    assert used == len(want_ids) and used % block == 0
    assert capacity % block == 0 and capacity >= used
    assert align.block_expert.numel() == capacity // block
    assert align.sorted_ids[:used].tolist() == want_ids
    assert (align.sorted_ids[used:] == tokens * top_k).all()  # unused room: padding only
    assert align.block_expert[: used // block].tolist() == want_blocks
    assert (align.block_expert[used // block :] == -1).all()


@needs_triton
def test_triton_kernel_is_interpreted_exactly_when_there_is_no_gpu() -> None:
    create_moe_backend("triton", torch.device(DEVICE))
    from minisgl.kernel import fused_moe

    assert fused_moe.INTERPRETED == (not CUDA)


@needs_triton
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 64, 32), (3, 64, 32), (17, 64, 32),
                                                 (40, 64, 32), (100, 64, 32), (2, 80, 48),
                                                 (33, 80, 48)])
def test_triton_backend_equals_dense_reference(tokens: int, hidden: int, inter: int) -> None:
    """1 token (2 pairs), counts that are not a multiple of the block (16 at <= 32 pairs, 64
    above), two experts that no token picks, and widths that leave a partial last K tile (80
    and 48 in tiles of 64 or 32)."""
    x, gate_up, down, logits = random_layer(tokens, hidden=hidden, inter=inter,
                                            seed=100 + tokens, unused=(2, 5))
    _, ids = select_experts(logits, 2, True)
    assert not torch.isin(ids, torch.tensor([2, 5], device=DEVICE)).any()
    out = create_moe_backend("triton", torch.device(DEVICE)).forward(x, gate_up, down, logits,
                                                                     2, True)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert_close(out, dense_moe(x, gate_up, down, logits, 2, True))


@needs_triton
@pytest.mark.parametrize("tokens", [1, 40])
def test_triton_backend_in_bfloat16(tokens: int) -> None:
    """bfloat16 weights and activations (float32 accumulation), against the float64 MoE of the
    same bfloat16 numbers: relative error within the book's bf16 bound. (Interpreted, Triton
    3.9 rounds float32 -> bfloat16 toward zero, about 1e-2 here; a GPU rounds to nearest.)"""
    x, gate_up, down, logits = random_layer(tokens, seed=200 + tokens)
    x, gate_up, down = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    out = create_moe_backend("triton", torch.device(DEVICE)).forward(x, gate_up, down, logits,
                                                                     2, True)
    assert out.dtype == torch.bfloat16
    ref = dense_moe(x, gate_up, down, logits, 2, True)
    assert float((out.double().cpu() - ref.cpu()).norm() / ref.norm()) <= 2e-2


@needs_triton
def test_triton_one_expert_with_exactly_a_block() -> None:
    """16 tokens, 32 pairs (block 16): expert 3 is every token's first choice, so its run is
    exactly one full block; the second choices spread over 0, 1 and 6, weights given."""
    x, gate_up, down, _ = random_layer(16, seed=7)
    second = torch.tensor([0, 1, 6] * 5 + [0])
    ids = torch.stack([torch.full((16,), 3), second], dim=1).to(DEVICE)
    weights = torch.rand(16, 2, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    assert block_sizes(ids.numel(), 8)[0] == 16
    out = create_moe_backend("triton", torch.device(DEVICE)).experts(x, gate_up, down, weights,
                                                                     ids)
    mix = torch.zeros(16, 8, dtype=torch.float64, device=DEVICE).scatter(1, ids,
                                                                          weights.double())
    assert_close(out, dense_experts(x, gate_up, down, mix))


def test_backend_names() -> None:
    assert resolve_moe_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_moe_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(KeyError, match="choose from: torch, triton"):
        resolve_moe_backend("trition", torch.device("cpu"))


def test_minisgl_runs_without_triton() -> None:
    """Triton hidden from the imports (a fresh process): the package, the model and the
    server's arguments still import, auto picks torch even on a GPU, and asking for triton says
    to install it."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # `import triton` now fails, as if it were not installed
        import torch
        import minisgl.engine, minisgl.llm, minisgl.models.qwen3_moe, minisgl.server.args
        from minisgl.moe import create_moe_backend, resolve_moe_backend
        assert resolve_moe_backend("auto", torch.device("cuda")) == "torch"
        try:
            create_moe_backend("triton", torch.device("cpu"))
        except ImportError as e:
            print(e)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs Triton: pip install triton" in out.stdout


@needs_triton
def test_compiled_triton_on_the_cpu_is_refused_with_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.kernel import fused_moe

    monkeypatch.setattr(fused_moe, "INTERPRETED", False)  # as if TRITON_INTERPRET were unset
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1") as e:
        create_moe_backend("triton", torch.device("cpu"))
    assert "--moe-backend torch" in str(e.value)


@needs_triton
def test_the_kernel_compiles_for_hopper() -> None:
    """The interpreter accepts code the compiler refuses (tile shapes, dtypes): so the kernel is
    also compiled, in a process without TRITON_INTERPRET, to a Hopper (sm90) binary by Triton's
    own ptxas, for the three configurations the backend launches. No GPU is needed to compile;
    running the binary is the GPU tests' (below, and tests/gpu/test_gpu_moe.py)."""
    code = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from minisgl.kernel import fused_moe

        kernel = fused_moe._expert_gemm_kernel
        assert not fused_moe.INTERPRETED
        runtime = {"a_ptr": "*D", "b_ptr": "*D", "c_ptr": "*D", "weight_ptr": "*fp32",
                   "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}
        for dtype, bm, bn, bk, div, mul in (("bf16", 16, 64, 64, 8, False),
                                            ("bf16", 64, 64, 32, 1, True),
                                            ("fp32", 64, 64, 32, 2, True)):
            const = {"A_ROW_DIV": div, "MUL_WEIGHT": mul, "UPCAST": False, "BLOCK_M": bm,
                     "BLOCK_N": bn, "BLOCK_K": bk,
                     "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
            sig = {n: "constexpr" if n in const else runtime.get(n, "i32").replace("D", dtype)
                   for n in kernel.arg_names}
            src = ASTSource(fn=kernel, signature=sig, constexprs={
                (kernel.arg_names.index(n),): v for n, v in const.items()})
            out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            print(dtype, bm, len(out.asm["cubin"]), "wgmma" in out.asm["ptx"])
        """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines()]
    assert [r[:2] for r in rows] == [["bf16", "16"], ["bf16", "64"], ["fp32", "64"]]
    assert all(int(r[2]) > 0 for r in rows)  # a cubin for each
    assert rows[1][3] == "True"  # bf16 in 64-row tiles: Hopper's warpgroup MMA (wgmma)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@needs_triton
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_compiled_triton_bf16_on_cuda(tokens: int) -> None:
    """The compiled kernel in bfloat16 on a Qwen3-30B-A3B-like width (128 experts, top 8)."""
    x, gate_up, down, logits = random_layer(tokens, experts=128, hidden=256, inter=96,
                                            seed=tokens)
    args = [t.bfloat16() for t in (x, gate_up, down)]
    out = create_moe_backend("triton", torch.device("cuda")).forward(*args, logits, 8, True)
    ref = dense_moe(*args, logits, 8, True)
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
