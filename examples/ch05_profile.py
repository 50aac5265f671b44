"""第 5 章示例：用 torch.profiler 看一步 decode 里都花在了哪里、发了多少个算子（GPU 上是 kernel）。

    python examples/ch05_profile.py                      # CPU，SmolLM2，8 个请求
    python examples/ch05_profile.py --device cuda --model models/qwen3-0.6b-random --batch 64
    python examples/ch05_profile.py --quick              # 冒烟测试：2 个请求，4 步

先让 --batch 个请求（随机 token，长度 100～512，种子 0）一起 prefill 并 decode 几步预热，
再用 profiler 记下 --steps 步 decode，打印：每步的平均耗时、每步的算子（或 kernel）个数、
每步调用 scaled_dot_product_attention 的次数，以及按自身耗时排序的前 12 个算子。
"""

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.llm.llm import RequestStatus  # noqa: E402
from minisgl.scheduler.utils import PendingReq  # noqa: E402
from minisgl.utils.device import stream_context  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="profile decode steps of minisgl's LLM")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 requests, 4 steps")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps = 2, 4
    on_gpu = args.device.startswith("cuda")
    llm = LLM(str(args.model), device=args.device, cache_type="naive",
              max_running_req=max(args.batch, 8))
    rng = random.Random(0)
    vocab = llm.vocab_size
    warm = 3
    params = SamplingParams(max_tokens=1 + warm + args.steps + 1, ignore_eos=True)
    for uid in range(args.batch):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(100, 512))]
        llm.queue.append(PendingReq(uid, torch.tensor(ids, dtype=torch.int32), params))
        llm.status[uid] = RequestStatus(ignore_eos=True)

    @torch.inference_mode()
    def step() -> None:  # one step without overlap: schedule, launch, wait, hand out tokens
        with stream_context(llm.engine.stream):
            llm.normal_loop()

    step()  # the prefill batch (chunked if the prompts exceed max_extend_tokens)
    while llm.stats.decode_batches < warm:
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    first = llm.stats.decode_batches
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    steps = llm.stats.decode_batches - first
    events = prof.key_averages()
    kernels = sum(e.count for e in events if on_gpu and e.device_type.name == "CUDA")
    aten_ops = sum(e.count for e in events if e.key.startswith("aten::"))
    sdpa = sum(e.count for e in events if e.key == "aten::scaled_dot_product_attention")
    print(f"{args.model.name} on {args.device}, {args.batch} requests of 100-512 prompt tokens, "
          f"{steps} decode steps profiled")
    print(f"time per decode step (with the profiler on): {elapsed / steps * 1000:.1f} ms")
    print(f"per decode step: {aten_ops / steps:.0f} aten ops, "
          f"{sdpa / steps:.0f} scaled_dot_product_attention calls"
          + (f", {kernels / steps:.0f} CUDA kernels" if on_gpu else ""))
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=12, max_name_column_width=40))
    llm.shutdown()


if __name__ == "__main__":
    main()
