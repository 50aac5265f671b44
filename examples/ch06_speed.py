"""第 6 章示例：batch 为 1 时一步 decode 要多久——我们的 Engine 与 HF transformers 并排测，
并看线程数（物理核数与 4 倍超额订阅）的影响。SmolLM2-135M-Instruct，float32。

    python examples/ch06_speed.py [--steps 30]
    python examples/ch06_speed.py --quick      # 冒烟测试：同样的代码，预热 1 步、计时 2 步

每个配置：32 个 token 的提示词先 prefill，然后我们与 HF 轮流各走一步 decode（交替进行，
两边经历同样的机器状态），预热 5 步后各计时 --steps 步，取中位数。
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "chapters" / "ch06_engine"))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine import Engine, EngineConfig  # noqa: E402
from minisgl.utils.device import physical_cores  # noqa: E402

from skeleton import HandBatcher  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
PROMPT = list(range(1000, 1032))
WARMUP = 5


def ours_steps(engine: Engine) -> Iterator[float]:
    """Prefill the prompt, then yield the time of each decode step (make the batch, forward,
    sample, copy the token back)."""
    batcher = HandBatcher(engine)
    req = batcher.add(0, PROMPT, SamplingParams(max_tokens=10_000, ignore_eos=True))
    phase = "prefill"
    while True:
        start = time.perf_counter()
        batch = batcher.make_batch([req], phase)
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        out.copy_done.synchronize()
        req.append_host(out.next_tokens_cpu)
        if phase == "decode":
            yield time.perf_counter() - start
        phase = "decode"


@torch.no_grad()
def hf_steps(model: torch.nn.Module) -> Iterator[float]:
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    while True:
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        yield time.perf_counter() - start


def interleaved(engine: Engine, model: torch.nn.Module, steps: int) -> tuple[float, float]:
    """Medians (ms) of `steps` decode steps each, ours and HF's taken in turns, so that both
    see the same machine at the same moments; the first WARMUP steps of each are dropped."""
    ours, hf = ours_steps(engine), hf_steps(model)
    pairs = [(next(ours), next(hf)) for _ in range(WARMUP + steps)][WARMUP:]
    return (statistics.median(p[0] for p in pairs) * 1000,
            statistics.median(p[1] for p in pairs) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 warm-up, 2 steps")
    args = parser.parse_args()
    if args.quick:  # what `tools/steps.py check` runs: the same code, in seconds
        global WARMUP
        WARMUP, args.steps = 1, 2
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "smollm2"], check=True)
    os.environ.pop("OMP_NUM_THREADS", None)
    cores = physical_cores()
    print(f"machine: {platform.machine()}, {os.cpu_count()} logical CPUs, {cores} physical cores;"
          f" torch {torch.__version__}; date {datetime.date.today()}")
    engine = Engine(EngineConfig(str(MODEL), num_page_override=256, max_running_req=4))
    print(f"Engine picked {engine.num_threads} threads (physical cores / TP)")
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    print(f"one decode step at batch 1, median of {args.steps} warm steps taken in turns:")
    for threads in (cores, 4 * cores):
        torch.set_num_threads(threads)
        ours, ref = interleaved(engine, hf, args.steps)
        print(f"  {threads} threads: minisgl {ours:.1f} ms, HF {ref:.1f} ms "
              f"(HF / minisgl = {ref / ours:.2f}x)")
    engine.shutdown()


if __name__ == "__main__":
    main()
