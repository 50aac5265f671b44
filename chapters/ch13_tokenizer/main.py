"""第 13 章的 main：三个进程。主进程扮演 API server，发 TokenizeMsg（对话、纯文本、带停止串的），
收 UserReply 的增量文字并原样打印，增量之间用 | 隔开；tokenizer 进程分词、反分词、截停止串；
后端子进程仍是第 12 章那样的替身（第 14 章换成真正的调度器进程），逐个 token 回发。"""

import multiprocessing as mp
import signal
import sys
from pathlib import Path

from minisgl.core import SamplingParams
from minisgl.message import (
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.tokenizer import tokenizer_worker
from minisgl.utils.mp import IpcNamespace, ZmqPullQueue, ZmqPushQueue

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
REQUESTS = [  # (prompt, stop strings): a chat, plain text, token ids
    ([{"role": "user", "content": "What is the capital of France?"}], []),
    ([{"role": "user", "content": "Say hello with an emoji."}], []),
    ("The three primary colours are", []),
    ([{"role": "user", "content": "Count from one to ten in words."}], ["\n5"]),
    ([1, 2, 10**9], []),
]


def backend(model: str, inbox: str, outbox: str) -> None:
    """Stand-in for the scheduler (chapter 14): generate, then send one frame per token."""
    from minisgl.llm import LLM

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the with: sockets closed
    llm = LLM(model)
    with ZmqPullQueue(inbox, bind=True, expected=BatchBackendMsg) as pull, \
            ZmqPushQueue[BatchTokenizerMsg](outbox, bind=False) as push:
        while True:
            msg = pull.get()
            assert msg is not None
            for req in (m for m in msg.data if isinstance(m, UserMsg)):
                ids = llm.generate([req.input_ids.tolist()], req.sampling_params)[0]["token_ids"]
                stopped = len(ids) < req.sampling_params.max_tokens  # generate drops the EOS
                for i, token in enumerate(ids):
                    last = i == len(ids) - 1
                    reason = ("stop" if stopped else "length") if last else None
                    push.put(BatchTokenizerMsg([DetokenizeMsg(req.uid, token, last, reason)]))


def main() -> None:
    ns = IpcNamespace()
    ctx = mp.get_context("spawn")
    tokenizer_addr, backend_addr, frontend_addr = (ns.addr(n) for n in ("tok", "back", "front"))
    procs = [ctx.Process(target=backend, args=(str(MODEL), backend_addr, tokenizer_addr)),
             ctx.Process(target=tokenizer_worker, kwargs=dict(
                 model_path=str(MODEL), inbox=tokenizer_addr, bind_inbox=True,
                 backend=backend_addr, frontend=frontend_addr))]
    with ZmqPullQueue(frontend_addr, bind=True, expected=BatchFrontendMsg) as replies, \
            ZmqPushQueue[BatchTokenizerMsg](tokenizer_addr, bind=False) as to_tokenizer:
        for p in procs:
            p.start()
        params = SamplingParams(max_tokens=40)
        for uid, (prompt, stop) in enumerate(REQUESTS):
            to_tokenizer.put(BatchTokenizerMsg([TokenizeMsg(uid, prompt, params, stop)]))
            got: list[UserReply] = []
            while not (got and got[-1].finished):  # one request at a time
                batch = replies.get()
                assert batch is not None
                got += batch.data  # a frame holds every reply of one wake-up
            pieces, reply = [r.incremental_output for r in got], got[-1]
            print(f"[{uid}] stop={stop} -> {len(pieces)} replies, finish_reason "
                  f"{reply.finish_reason!r}, usage {reply.prompt_tokens} + "
                  f"{reply.completion_tokens} tokens" + (f", error: {reply.error}" if reply.error
                                                          else ""))
            print("    " + "|".join(pieces).replace("\n", "\\n"))
    for p in procs:
        p.terminate()
        p.join(timeout=10)
    ns.remove()
    print(f"exit codes {[p.exitcode for p in procs]}; ipc folder left: {ns.root.exists()}")


if __name__ == "__main__":
    main()
