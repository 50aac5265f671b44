"""第 12 章的 main：两个进程经 ZMQ + msgpack 说话。子进程持有第 11 章的 LLM，收 UserMsg、
回 DetokenizeMsg；主进程用聊天模板分词、发请求、收 token、还原文字。中间混进一帧坏数据，
子进程拒收后照常服务。"""

import multiprocessing as mp
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from minisgl.core import SamplingParams
from minisgl.message import (
    BatchBackendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    ExitMsg,
    UserMsg,
    encode,
)
from minisgl.utils.mp import IpcNamespace, ZmqPullQueue, ZmqPushQueue

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "用一句话介绍你自己。", "Say hello with an emoji."]


def backend(model: str, inbox: str, outbox: str) -> None:
    """The child: a stand-in for the scheduler process of chapter 14."""
    from minisgl.llm import LLM

    llm = LLM(model)
    with ZmqPullQueue(inbox, bind=True, expected=BatchBackendMsg | ExitMsg) as pull, \
            ZmqPushQueue[BatchTokenizerMsg](outbox, bind=False) as push:
        while not isinstance(msg := pull.get(), ExitMsg):
            assert isinstance(msg, BatchBackendMsg)
            reqs = [m for m in msg.data if isinstance(m, UserMsg)]
            outs = llm.generate([r.input_ids.tolist() for r in reqs],
                                [r.sampling_params for r in reqs])
            for req, out in zip(reqs, outs):  # one frame per request, one message per token
                ids = out["token_ids"]
                push.put(BatchTokenizerMsg([DetokenizeMsg(req.uid, t, i == len(ids) - 1)
                                            for i, t in enumerate(ids)]))
        print(f"backend: refused {pull.refused} malformed frame(s), exiting", flush=True)
    llm.shutdown()


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    ns = IpcNamespace()
    inbox, outbox = ns.addr("backend"), ns.addr("tokenizer")
    with ZmqPullQueue(outbox, bind=True, expected=BatchTokenizerMsg) as pull, \
            ZmqPushQueue[BatchBackendMsg | ExitMsg](inbox, bind=False) as push:
        child = mp.get_context("spawn").Process(target=backend, args=(str(MODEL), inbox, outbox))
        child.start()
        reqs = []
        for uid, question in enumerate(QUESTIONS):
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=False)
            ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.int32)
            reqs.append(UserMsg(uid, ids, SamplingParams(max_tokens=24)))
        batch = BatchBackendMsg(reqs)
        print(f"one BatchBackendMsg of {len(reqs)} UserMsg: {len(encode(batch))} bytes; "
              f"prompts of {[len(r.input_ids) for r in reqs]} tokens", flush=True)
        push.socket.send(b"\x00 not msgpack")  # a malformed frame: refused, not fatal
        push.put(batch)
        tokens: dict[int, list[int]] = {r.uid: [] for r in reqs}
        done: set[int] = set()
        while len(done) < len(reqs):
            reply = pull.get()
            assert reply is not None
            for m in reply.data:
                assert isinstance(m, DetokenizeMsg)
                tokens[m.uid].append(m.next_token)
                if m.finished:
                    done.add(m.uid)
        for uid, question in enumerate(QUESTIONS):
            answer = tokenizer.decode(tokens[uid], skip_special_tokens=True)
            print(f"[{uid}] {question}\n    -> {answer!r}", flush=True)
        push.put(ExitMsg())
        child.join(timeout=60)
    ns.remove()
    print(f"backend exit code {child.exitcode}; ipc folder left behind: {ns.root.exists()}")


if __name__ == "__main__":
    main()
