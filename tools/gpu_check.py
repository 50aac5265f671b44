"""GPU checks in one run (chapter 6 so far): the stage-1 Engine on CUDA against HF, float32.

    python tools/gpu_check.py            # on a machine with CUDA and models/tiny-* made

Prints one line per check and a summary; exits 1 if any check fails. CI has no GPU and never
runs this; the book records its output with the machine and date.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "chapters" / "ch06_engine")]

import torch  # noqa: E402
import transformers  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine import Engine, EngineConfig  # noqa: E402

from skeleton import HandBatcher  # noqa: E402

MODELS = ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral"]
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 72)), [11, 12]]


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], list]:
    x = torch.tensor([ids], device="cuda")
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [t[0].float() for t in out.logits]


def check_engine(name: str) -> list[str]:
    path = ROOT / "models" / name
    engine = Engine(EngineConfig(str(path), dtype=torch.float32, num_page_override=256,
                                 max_running_req=8, page_size=4))
    assert engine.device.type == "cuda", engine.device
    seen: list[torch.Tensor] = []
    sample = engine.sampler.sample
    engine.sampler.sample = lambda logits, args: (seen.append(logits.clone()),  # type: ignore
                                                  sample(logits, args))[1]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    ours = HandBatcher(engine).generate(PROMPTS, greedy)
    engine.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    hf.generation_config.eos_token_id = None
    lines = []
    for i, (ids, tokens) in enumerate(zip(PROMPTS, ours)):
        ref, ref_logits = hf_greedy(hf, ids, 16)
        worst = max(float((s[i] - r).abs().max()) for s, r in zip(seen, ref_logits))
        ok = tokens == ref and worst <= 1e-3
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name} request {i} ({len(ids)} tokens, in a "
                     f"batch of 4): same 16 tokens as HF {tokens == ref}, max |dlogit| {worst:.1e}")
    return lines


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script is for a GPU machine")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; date {datetime.date.today()}")
    lines = [line for name in MODELS for line in check_engine(name)]
    print("\n".join(lines))
    failed = sum(line.startswith("FAIL") for line in lines)
    print(f"summary: {len(lines) - failed} ok, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
