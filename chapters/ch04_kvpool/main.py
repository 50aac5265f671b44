"""第 4 章的 main：K/V 写进分页 KV 池、经 page table 读出；页大小 1 和 4 各生成一次，与 HF 对照。"""

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
    refs = [hf_greedy(MODEL, ids, 16)[0] for ids in prompts]
    for page_size in (1, 4):
        set_global_ctx(Context(page_size=page_size))
        model, config = load_model(MODEL)
        batcher = PagedBatcher(config, num_pages=64, page_size=page_size, max_running_req=4,
                               max_seq_len=256)
        pool = get_global_ctx().kv_cache
        print(f"page_size={page_size}: KV buffer {tuple(pool._buffer.shape)}, "  # type: ignore
              f"page table {tuple(get_global_ctx().page_table.shape)}")
        outputs = batcher.generate(model, prompts, max_tokens=16)
        for ids, out, ref in zip(prompts, outputs, refs):
            row = get_global_ctx().page_table[0, : len(ids) + 16].tolist()
            print(f"  {tokenizer.decode(out)!r}: same as HF {out == ref}")
        print(f"  request 0's slots: {row[:12]} ...")
        set_global_ctx(None)


if __name__ == "__main__":
    main()
