"""第 14 章的 main：真正的调度器进程上场。主进程扮演 API server，tokenizer 进程在中间，调度器进程
（第 7～11 章的循环，只换了收发）在后面。5 个请求一起发出：3 个正常生成，1 个收到 3 段回复后
被主进程中止，1 个提示词超过上下文长度、立刻得到错误回复；最后发 ExitMsg，各进程干净退出。"""

import multiprocessing as mp
import sys
from pathlib import Path

import torch

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortMsg,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    ExitMsg,
    TokenizeMsg,
    UserReply,
)
from minisgl.scheduler import SchedulerConfig
from minisgl.scheduler.io import scheduler_worker
from minisgl.tokenizer import tokenizer_worker
from minisgl.utils.mp import IpcNamespace, ZmqPullQueue, ZmqPushQueue

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct")
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
             "Tell me a long story about a dragon."]
ABORTED = 3  # the story: cut off by the client after three replies


def main() -> None:
    ns = IpcNamespace()
    addr = {name: ns.addr(name) for name in ("tokenizer", "scheduler", "api")}
    config = SchedulerConfig(model_path=str(MODEL), dtype=torch.float32)
    ctx = mp.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=scheduler_worker, name="scheduler",
                         args=(config, addr["scheduler"], addr["tokenizer"], ready_send)),
             ctx.Process(target=tokenizer_worker, name="tokenizer", kwargs=dict(
                 model_path=str(MODEL), inbox=addr["tokenizer"], bind_inbox=True,
                 backend=addr["scheduler"], frontend=addr["api"], ready=ready_send))]
    with ZmqPullQueue(addr["api"], bind=True, expected=BatchFrontendMsg) as replies, \
            ZmqPushQueue[BatchTokenizerMsg](addr["tokenizer"], bind=False) as to_tokenizer:
        for p in procs:
            p.start()
        print("ready:", sorted(ready_recv.recv() for _ in procs), flush=True)
        params = SamplingParams(max_tokens=24)
        msgs = [TokenizeMsg(uid, [{"role": "user", "content": q}], params, [])
                for uid, q in enumerate(QUESTIONS)]
        msgs.append(TokenizeMsg(4, list(range(9000)), params, []))  # longer than the context
        to_tokenizer.put(BatchTokenizerMsg(msgs))
        got: dict[int, list[UserReply]] = {uid: [] for uid in range(len(msgs))}
        while not all(r and r[-1].finished for r in got.values()):
            batch = replies.get()
            assert batch is not None
            for reply in batch.data:
                got[reply.uid].append(reply)
                if reply.uid == ABORTED and len(got[ABORTED]) == 3:
                    to_tokenizer.put(BatchTokenizerMsg([AbortMsg(ABORTED)]))
        for uid, rs in got.items():
            last = rs[-1]
            text = "".join(r.incremental_output for r in rs)
            if uid == ABORTED:  # how far it got depends on timing: say only what is certain
                text = f"(cut off; fewer than 24 tokens: {last.completion_tokens < 24})"
            print(f"[{uid}] {last.finish_reason:<6} {last.prompt_tokens:>4} prompt tokens: "
                  f"{text if uid == ABORTED else repr(text)}"
                  + (f"\n      error: {last.error}" if last.error else ""), flush=True)
        with ZmqPushQueue[BatchBackendMsg](addr["scheduler"], bind=False) as to_scheduler:
            to_scheduler.put(BatchBackendMsg([ExitMsg()]))
            procs[0].join(timeout=30)
    procs[1].terminate()
    procs[1].join(timeout=10)
    ns.remove()
    print(f"exit codes: {[(p.name, p.exitcode) for p in procs]}; ipc folder left: "
          f"{ns.root.exists()}", flush=True)


if __name__ == "__main__":
    main()
