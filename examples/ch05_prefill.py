"""第 5 章示例：prefill 时，补齐成一块的批量注意力与逐个请求的循环，哪个快？

    python examples/ch05_prefill.py          # SmolLM2 的头数：9 个 q 头、3 个 kv 头、head_dim 64
    python examples/ch05_prefill.py --quick  # 冒烟测试：每种 2 次

两种批：8 个一样长的提示词（补齐不浪费），和 1 个长提示词加 7 个短的（补齐浪费最多）。
每种批上，同一层的注意力用两种做法各算若干次（轮流），取中位数；两者的输出先核对一致。
逐个请求的循环写在本文件里，只作比较：它就是第 5 章方框里的“第一个想法”。
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minisgl.attention.torch_backend import TorchBackend  # noqa: E402
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx  # noqa: E402
from minisgl.kvcache import create_kvcache_pool  # noqa: E402
from minisgl.models import ModelConfig  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
BATCHES = {"8 x 256 tokens": [256] * 8, "1 x 1024 + 7 x 32 tokens": [1024] + [32] * 7}


def loop_attention(q: torch.Tensor, ctx: Context, lens: list[int], scale: float) -> torch.Tensor:
    """The per-request loop: gather one request's K/V, repeat the kv heads, one SDPA each."""
    k_cache, v_cache = ctx.kv_cache.k_cache(0), ctx.kv_cache.v_cache(0)
    out, start, group = torch.empty_like(q), 0, HEADS // KV_HEADS
    for row, n in enumerate(lens):
        slots = ctx.page_table[row, :n].long()
        ki = k_cache[slots].transpose(0, 1).repeat_interleave(group, dim=0)
        vi = v_cache[slots].transpose(0, 1).repeat_interleave(group, dim=0)
        qi = q[start:start + n].transpose(0, 1)
        out[start:start + n] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True,
                                                              scale=scale).transpose(0, 1)
        start += n
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reps = 2 if args.quick else args.reps
    config = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 576,
        "intermediate_size": 1536, "vocab_size": 64, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096})
    print(f"one layer's prefill attention, {HEADS} q heads / {KV_HEADS} kv heads, head_dim "
          f"{HEAD_DIM}, float32, {torch.get_num_threads()} threads; median of {reps} runs each")
    gen = torch.Generator().manual_seed(0)
    for name, lens in BATCHES.items():
        compare(name, lens, config, gen, reps)

def compare(name: str, lens: list[int], config: ModelConfig, gen: torch.Generator,
            reps: int) -> None:
    """One prefill batch of prompts of these lengths (no cached prefix): both ways, timed."""
    ctx = Context(page_size=1)
    set_global_ctx(ctx)
    total = sum(lens)
    ctx.kv_cache = create_kvcache_pool(config, total, 1, torch.device("cpu"), torch.float32)
    ctx.page_table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    slots = torch.randperm(total, generator=gen).to(torch.int32)
    reqs, start = [], 0
    for row, n in enumerate(lens):
        ctx.page_table[row, :n] = slots[start:start + n]
        reqs.append(Req(torch.zeros(n, dtype=torch.int32), row, 0, 1, row, SamplingParams()))
        start += n
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    ctx.kv_cache.store_kv(k, v, torch.cat([ctx.page_table[r, :n] for r, n in
                                           enumerate(lens)]).long(), 0)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    batch = Batch(reqs, "prefill")
    batch.padded_reqs = reqs
    backend = TorchBackend(config)
    backend.prepare_metadata(batch)
    runs = {"batched": lambda: backend.forward(q, k, v, 0, batch),
            "per-request loop": lambda: loop_attention(q, ctx, lens, backend.scale)}
    outs = {label: run() for label, run in runs.items()}
    same = torch.allclose(outs["batched"], outs["per-request loop"], atol=1e-5)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(reps):  # in turns
        for label, run in runs.items():
            begin = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - begin)
    real = sum(n * n for n in lens)  # query-key pairs (before the causal half)
    padded = len(lens) * max(lens) ** 2
    print(f"{name}: padded work {padded / real:.1f}x the real work; outputs agree: {same}")
    for label, ts in times.items():
        print(f"  {label:<17} {statistics.median(ts) * 1e3:8.2f} ms")
    set_global_ctx(None)

if __name__ == "__main__":
    main()
