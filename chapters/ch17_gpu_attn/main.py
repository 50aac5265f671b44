"""第 17 章的 main：GPU 注意力后端。`--attn auto` 先按设备选后端并记一行日志；随后同一批 4 个对话
依次用 torch、fi、fa,fi、torch,fi 四种后端生成，贪心 token 逐个相同。机器上没有真的 FlashInfer
和 sgl-kernel 时（CPU 上总是如此），fi 和 fa 跑在 tests/fakes 的假模块上：签名与真库相同，里面是
torch 参考实现，并检查我们传的每个参数。最后打印一个 decode 批交给 plan 的布局：page size 4 的池子，
在 FlashInfer 眼里是一 token 一页。"""

import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from minisgl.attention import resolve_backend_name
from minisgl.core import SamplingParams
from minisgl.llm import LLM

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "What is 2 + 2?", "Say hello in Spanish."]
BACKENDS = ["torch", "fi", "fa,fi", "torch,fi"]


def use_fakes_if_needed(device: torch.device) -> bool:
    """The real kernels need a GPU and the packages; otherwise the fakes stand in."""
    real = device.type == "cuda" and all(
        importlib.util.find_spec(m) for m in ("flashinfer", "sgl_kernel"))
    if not real:  # for this process and for the server's processes
        fakes = str(Path("tests/fakes").resolve())
        sys.path.insert(0, fakes)
        os.environ["PYTHONPATH"] = os.pathsep.join([fakes, os.environ.get("PYTHONPATH", "")])
    return not real


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolve_backend_name("auto", device)  # logs its choice and the reason
    fake = use_fakes_if_needed(device)
    if fake:
        import flashinfer  # the fake: it records every plan and run call

        where = Path(flashinfer.__file__).parent.parent.name
        print(f"flashinfer and sgl_kernel here are the fakes in {where}/")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
               for q in QUESTIONS]
    params = SamplingParams(max_tokens=16)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    results = {}
    for name in BACKENDS:
        if fake:
            flashinfer.calls.clear()
            flashinfer.layouts.clear()
        llm = LLM(str(MODEL), dtype=dtype, attention_backend=name, page_size=4,
                  num_page_override=256)
        out = llm.generate(prompts, params)
        results[name] = [o["token_ids"] for o in out]
        stats = llm.stats
        line = (f"--attn {name:8} same tokens as torch: {results[name] == results['torch']}; "
                f"batches: {stats.prefill_batches} prefill, {stats.decode_batches} decode")
        if fake and name != "torch":
            plans = [kind for kind, what in flashinfer.calls if what == "plan"]
            runs = sum(what == "run" for _, what in flashinfer.calls)
            line += f"; FlashInfer plan {len(plans)}x, run {runs}x ({runs // len(plans)} per plan)"
        print(line)
        if name == "fi" and fake:
            show_decode_layout(next(x for x in flashinfer.layouts if x["kind"] == "decode"))
        llm.shutdown()
    answer = tokenizer.decode(results["fa,fi"][0], skip_special_tokens=True)
    print(f"answer 1: {answer!r}")
    serve("fa,fi", QUESTIONS[0], answer)


def serve(backend: str, question: str, expected: str) -> None:
    """The same pair behind `python -m minisgl --attn`, one streamed chat over HTTP."""
    sys.path.insert(0, str(Path("tests").resolve()))
    from helpers import ask_server
    from serving import gone  # the server harness of the tests

    with tempfile.TemporaryDirectory() as tmp:
        text, code, server = ask_server(MODEL, Path(tmp), question, "--attn", backend,
                                        max_tokens=16)
        print(f"python -m minisgl --attn {backend}: streamed {text!r}; same as offline: "
              f"{text == expected}; exit code {code}, all {len(server.pids())} processes "
              f"gone: {gone(server.pids(), 10)}")


def show_decode_layout(layout: dict) -> None:
    """The first decode batch's plan: slot numbers of a pool with 4-token pages, one per page."""
    indptr, indices = layout["kv_indptr"], layout["indices"].tolist()
    print(f"  first decode plan: page_size={layout['page_size']}, kv_indptr={indptr}")
    rows = [indices[indptr[i]:indptr[i + 1]] for i in range(len(indptr) - 1)]
    for i, slots in enumerate(rows):
        shared = next((j for j, (a, b) in enumerate(zip(slots, rows[0])) if a != b), len(slots))
        print(f"  request {i}: {len(slots)} keys, the first {shared} in request 0's slots; "
              f"last six {slots[-6:]}")


if __name__ == "__main__":
    main()
