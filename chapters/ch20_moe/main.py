"""第 20 章的 main：MoE。tiny-qwen3-moe 每层 8 个专家、每个 token 选 2 个：先看路由器给一个
提示词的每个 token 选了谁、权重多少；再看 triton 后端怎样把 (token, 槽位) 对按专家排好、补齐到
块的整数倍；最后两个后端（torch 的逐专家循环，和 Triton 的 fused MoE，CPU 上在 Triton 的解释器
里跑）各生成 12 个 token，与 HF 逐 token 相同。"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is imported: CPU, no GPU

import torch

from minisgl.core import SamplingParams
from minisgl.layers.moe import MoELayer
from minisgl.llm import LLM
from minisgl.moe import select_experts
from minisgl.moe.triton_backend import align_block_size

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-qwen3-moe")
PROMPT = [17, 230, 5, 88, 412, 9]


def routing(router_logits: torch.Tensor) -> torch.Tensor:
    """What layer 0's router chose for the prompt's tokens during the prefill."""
    weights, ids = select_experts(router_logits, 2, True)
    print("layer 0, each prompt token's experts (weights renormalised to sum to 1):")
    for t, (w, e) in enumerate(zip(weights.tolist(), ids.tolist())):
        print(f"  token {PROMPT[t]:>3}: experts {e} weights [{w[0]:.3f}, {w[1]:.3f}]")
    return ids


def alignment(ids: torch.Tensor) -> None:
    align = align_block_size(ids, block=4, num_experts=8)
    n = ids.numel()
    print(f"{n} (token, slot) pairs, sorted by expert, each run padded to blocks of 4 "
          f"(padding shown as -):")
    shown = ["-" if p == n else str(p) for p in align.sorted_ids.tolist()]
    used = int(align.num_padded)
    for b, e in enumerate(align.block_expert.tolist()):
        if b * 4 < used:
            print(f"  block {b}: expert {e}, pairs {' '.join(shown[b * 4:b * 4 + 4])}")
    print(f"  {used} entries in use of {len(shown)} allocated (a bound that depends on shapes "
          "only, so a CUDA graph can capture it)")


def generate(backend: str) -> tuple[list[int], float, torch.Tensor]:
    """12 greedy tokens, their max |Δlogit| against HF's (nan if the tokens differ), and the
    router logits of the first MoE layer's first call (layer 0, the prefill)."""
    first: list[torch.Tensor] = []
    forward = MoELayer.forward

    def spy(self: MoELayer, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if not first:
            first.append(router_logits.clone())
        return forward(self, x, router_logits)

    MoELayer.forward = spy  # type: ignore[method-assign]
    llm = LLM(str(MODEL), dtype=torch.float32, moe_backend=backend, num_page_override=256,
              max_seq_len_override=128)
    try:
        seen: list[torch.Tensor] = []
        sample = llm.engine.sampler.sample
        llm.engine.sampler.sample = lambda logits, args: seen.append(logits[0]) or sample(
            logits, args)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        llm.shutdown()
        MoELayer.forward = forward  # type: ignore[method-assign]
    sys.path.insert(0, str(Path("tests").resolve()))
    from reference import hf_greedy

    hf_tokens, hf_logits = hf_greedy(MODEL, PROMPT, 12)
    worst = max(float((a - b).abs().max()) for a, b in zip(seen, hf_logits))
    return out[0]["token_ids"], worst if out[0]["token_ids"] == hf_tokens else float("nan"), \
        first[0]


def main() -> None:
    for backend in ("torch", "triton"):
        tokens, worst, router_logits = generate(backend)
        if backend == "torch":
            alignment(routing(router_logits))
        # the last digit of a float32 difference this small depends on the CPU: a bound
        shown = "< 1e-05" if worst < 1e-5 else f"{worst:.1e}"
        print(f"--moe-backend {backend}: {tokens}; HF's tokens: {worst == worst}, "
              f"max |Δlogit| vs HF {shown}")


if __name__ == "__main__":
    main()
