"""`--shell` (chapter 15): a multi-turn chat in the terminal, on the same processes as the
server."""

from __future__ import annotations

import asyncio
import sys
from contextlib import aclosing

from minisgl.core import SamplingParams

from .args import ServerArgs
from .frontend import FrontendManager
from .processes import Addresses, Child, watch

HELP = "/reset forgets the conversation, /exit (or Ctrl-D) leaves"


async def run_shell(args: ServerArgs, addr: Addresses, children: list[Child]) -> int:
    manager = FrontendManager(addr.tokenizer if args.num_tokenizer else addr.detokenizer,
                              args.num_tokenizer > 0, addr.frontend)
    failures: list[str] = []
    watcher = asyncio.create_task(watch(children, manager, failures.append))
    try:
        while manager.state == "starting":
            await asyncio.sleep(0.1)
        if failures:
            print(f"error: {failures[0]}", file=sys.stderr)
            return 1
        print(f"{args.model_name} is ready. {HELP}.", flush=True)
        return await _chat(manager, args.scheduler.max_seq_len, failures)
    finally:
        watcher.cancel()
        manager.close()


async def _chat(manager: FrontendManager, max_seq_len: int, failures: list[str]) -> int:
    read = _reader()
    history: list[dict[str, str]] = []
    params = SamplingParams(max_tokens=max_seq_len)  # greedy; the scheduler clips to the room
    while (line := await read()) is not None:
        line = line.strip()
        if line == "/exit":
            break
        if line == "/reset":
            history.clear()
            print("(conversation reset)", flush=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        uid = await manager.submit(list(history), params, [])
        answer = []
        async with aclosing(manager.replies(uid)) as replies:
            async for reply in replies:
                if reply.error:
                    print(f"\nerror: {reply.error}", file=sys.stderr, flush=True)
                    history.pop()
                    break
                answer.append(reply.incremental_output)
                print(reply.incremental_output, end="", flush=True)
            else:
                history.append({"role": "assistant", "content": "".join(answer)})
                print(flush=True)
        if failures:
            return 1
    return 0


def _reader():  # type: ignore[no-untyped-def]
    """An async line reader: prompt_toolkit's (editing, history) on a terminal, else stdin."""
    if sys.stdin.isatty():
        from prompt_toolkit import PromptSession

        session: PromptSession[str] = PromptSession()

        async def prompt() -> str | None:
            try:
                return await session.prompt_async("> ")
            except EOFError:
                return None
        return prompt

    async def readline() -> str | None:
        line = await asyncio.to_thread(sys.stdin.readline)
        return line or None
    return readline
