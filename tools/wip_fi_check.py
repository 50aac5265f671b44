"""WIP (branch wip-ch17, not for main as is): chapter 17 on the H200, our fi backend with the
real FlashInfer vs the torch backend, bf16, Qwen3-0.6B shape with random weights: tokens,
logits error, eager decode step time."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "python")
import flashinfer  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402

PATH = sys.argv[1]
print("flashinfer", flashinfer.__version__, "torch", torch.__version__,
      torch.cuda.get_device_name())
g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(10, 150000, (n,), generator=g).tolist() for n in (37, 120, 300, 511)]


def make(backend, page_size=1):
    return LLM(PATH, dtype=torch.bfloat16, attention_backend=backend, page_size=page_size,
               num_page_override=65536, max_running_req=128, cache_type="naive")


def tokens_and_logits(backend, page_size=1):
    llm = make(backend, page_size)
    seen = []
    sample = llm.engine.sampler.sample
    llm.engine.sampler.sample = lambda x, a: seen.append(x.float().cpu()) or sample(x, a)
    t = time.perf_counter()
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    llm.shutdown()
    return [o["token_ids"] for o in out], seen, first


import os  # noqa: E402

ref, ref_logits, _ = tokens_and_logits("torch")
for ps in (1, 4, "1 overlap off"):  # noqa
    if ps == "1 overlap off":
        os.environ["MINISGL_DISABLE_OVERLAP_SCHEDULING"] = "1"
        ps = 1
    got, logits, first = tokens_and_logits("fi", ps)
    same = sum(a == b for a, b in zip(got, ref))
    # relative logits error while the batch is still identical (every step before a divergence)
    steps = min(len(logits), len(ref_logits))
    errs = []
    for step, (a, b) in enumerate(zip(logits[:steps], ref_logits[:steps])):
        # rows whose tokens so far are the torch backend's: the same inputs (teacher-forced)
        rows = [i for i in range(4) if got[i][:step] == ref[i][:step]]
        if a.shape != b.shape or not rows:
            break
        errs.append(max(float((a[i] - b[i]).abs().max() / b[i].abs().max()) for i in rows))
    print(f"fi page_size {ps}: {same}/4 requests give the torch backend's 32 greedy tokens; "
          f"max relative logits error over {len(errs)} steps {max(errs):.2e} "
          f"(median {statistics.median(errs):.2e}, first step {errs[0]:.2e}); "
          f"first call incl. JIT {first:.1f} s")


def decode_step_ms(llm, bs, n=64):
    prompts = [torch.randint(10, 150000, (128,), generator=g).tolist() for _ in range(bs)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n + 1, ignore_eos=True))
    torch.cuda.synchronize()
    return ((time.perf_counter() - t) - t1) / n * 1000


for bs in ((1, 64) if os.environ.get("SPEED") else ()):
    times = {"torch": [], "fi": []}
    for _ in range(3):
        for backend in ("torch", "fi"):
            llm = make(backend)
            decode_step_ms(llm, bs, 8)  # warm-up
            times[backend].append(decode_step_ms(llm, bs))
            llm.shutdown()
    print(f"eager decode step, batch {bs}: " + ", ".join(
        f"{k} {statistics.median(v):.2f} ms (runs {', '.join(f'{x:.2f}' for x in v)})"
        for k, v in times.items()))
