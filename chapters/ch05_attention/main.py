"""第 5 章的 main：torch 后端经 page table 读 K/V；提示词分两半接着算，与一次算完对照。"""

import sys
from pathlib import Path

from minisgl.core import Context, get_global_ctx, set_global_ctx

sys.path.insert(0, "tests")  # the HF reference every test aligns to
from reference import hf_greedy, hf_tokenizer, require_model
from skeleton import PagedBatcher, load_model

MODEL = Path("models/SmolLM2-135M-Instruct")
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


def main() -> None:
    tokenizer = hf_tokenizer(require_model(MODEL))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    set_global_ctx(Context(page_size=4))
    ctx = get_global_ctx()
    model, config = load_model(MODEL)
    batcher = PagedBatcher(config, num_pages=64, page_size=4, max_running_req=4, max_seq_len=256)
    print(f"attention backend: {type(ctx.attn_backend).__name__}")

    # 1. generation through the backend, checked against HF
    outputs = batcher.generate(model, prompts, max_tokens=16)
    for ids, out in zip(prompts, outputs):
        ref, _ = hf_greedy(MODEL, ids, 16)
        print(f"{tokenizer.decode(out)!r}: same as HF {out == ref}")

    # 2. a prefill that attends to a cached prefix: the second half of the prompt is computed
    #    on top of the first half's K/V, and must give the logits of a one-shot prefill
    ids = prompts[1]
    one = batcher.add(100, ids, max_tokens=1)
    with ctx.forward_batch(batcher.make_batch([one], "prefill")):
        whole = model.forward()[0]
    two = batcher.add(101, ids, max_tokens=1)
    two.device_len = len(ids) // 2  # first extend: only the first half
    with ctx.forward_batch(batcher.make_batch([two], "prefill")):
        model.forward()
    two.cached_len, two.device_len = len(ids) // 2, len(ids)  # second extend: the rest
    with ctx.forward_batch(batcher.make_batch([two], "prefill")):
        halves = model.forward()[0]
    print(f"prefill in two halves ({len(ids) // 2} cached + {len(ids) - len(ids) // 2} new) "
          f"vs one shot: max |Δlogit| <= 1e-4: {float((whole - halves).abs().max()) <= 1e-4}, "
          f"same argmax: {int(whole.argmax()) == int(halves.argmax())}")
    set_global_ctx(None)


if __name__ == "__main__":
    main()
