"""第 18 章的 main：CUDA Graph。CPU 上没有 CUDA graph，GraphRunner 换用 EmulatedGraph：重放时把
录下的那一步在录制时的批上再跑一遍，只读静态缓冲区里此刻的值。6 个对话各要不同长度的回答，decode
批从 6 缩到 1：关掉图和打开图（录 1、2、4、6）的贪心 token 逐个相同，3、5 补到 4、6；再故意不拷
positions，答案就变了；最后 `python -m minisgl --cuda-graph-max-bs 4` 起服务，日志里有录图的
那一行。"""

import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.engine.graph import GraphRunner
from minisgl.llm import LLM

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
             "Say hello in Spanish.", "What do bees make?", "Name a planet."]


def generate(prompts: list[list[int]], max_bs: int) -> tuple[list[list[int]], Counter]:
    """Greedy answers of 6 to 16 tokens, and how often each (size, padded size) was replayed."""
    replays: Counter = Counter()
    replay = GraphRunner.replay

    def counted(self: GraphRunner, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        replays[(batch.size, batch.padded_size)] += 1
        return replay(self, batch)

    GraphRunner.replay = counted  # type: ignore[method-assign]
    llm = LLM(str(MODEL), dtype=torch.float32, num_page_override=1024, cuda_graph_max_bs=max_bs,
              max_seq_len_override=128)
    try:
        params = [SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True)
                  for i in range(len(prompts))]
        out = [o["token_ids"] for o in llm.generate(prompts, params)]
        if max_bs:
            print(f"graphs for batch sizes {llm.engine.graph_runner.sizes}")
    finally:
        llm.shutdown()
        GraphRunner.replay = replay  # type: ignore[method-assign]
    return out, replays


def serve(question: str) -> None:
    sys.path.insert(0, str(Path("tests").resolve()))
    from helpers import ask_server
    from serving import gone  # the server harness of the tests

    with tempfile.TemporaryDirectory() as tmp:
        text, code, server = ask_server(MODEL, Path(tmp), question, "--cuda-graph-max-bs", "4",
                                        max_tokens=16)
        logged = [re.sub(r"\d+\.\d+ s", "_ s", line.split(": ", 1)[1])
                  for line in server.log.read_text().splitlines() if "graphs (" in line]
        print(f"python -m minisgl --cuda-graph-max-bs 4: log {logged}")
        print(f"  streamed {text!r}; exit code {code}, all processes gone: "
              f"{gone(server.pids(), 10)}")


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
               for q in QUESTIONS]
    eager, _ = generate(prompts, max_bs=0)
    graph, replays = generate(prompts, max_bs=6)
    print(f"graphs on: same tokens as eager for {sum(a == b for a, b in zip(graph, eager))}/6")
    for (size, padded), n in sorted(replays.items()):
        print(f"  batch of {size} replayed as {padded}: {n} steps")
    GraphRunner.INPUTS = ("input_ids", "out_loc")  # a planted bug: positions are not copied
    broken, _ = generate(prompts, max_bs=6)
    GraphRunner.INPUTS = ("input_ids", "positions", "out_loc")
    wrong = [i for i, (a, b) in enumerate(zip(broken, eager)) if a != b]
    print(f"positions not copied: {len(wrong)}/6 answers differ; answer {wrong[0]} became "
          f"{tokenizer.decode(broken[wrong[0]], skip_special_tokens=True)!r} instead of "
          f"{tokenizer.decode(eager[wrong[0]], skip_special_tokens=True)!r}")
    serve(QUESTIONS[0])


if __name__ == "__main__":
    main()
