"""The tokenizer process (chapter 13): tokenizes new requests for the scheduler and detokenizes
its tokens for the API server; one process does both unless --num-tokenizer asks for workers."""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack
from multiprocessing.connection import Connection

from transformers import AutoTokenizer

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BackendItem,
    BatchBackendMsg,
    BatchFrontendMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    DetokenizeSetupMsg,
    FrontendItem,
    StatsMsg,
    StatsReply,
    TokenizeMsg,
    TokenizerItem,
    TokenizerMsg,
    UserMsg,
    UserReply,
)
from minisgl.message.transport import ZmqPullQueue, ZmqPushQueue
from minisgl.utils.signals import exit_on_sigterm

from .detokenize import DetokenizeManager
from .tokenize import TokenizeManager


class TokenizerServer:
    """What one tokenizer process does with a batch of messages. With `forward_setups` set
    (a worker, when --num-tokenizer N > 0), new requests' setup goes to the detokenizer
    process instead of this one's DetokenizeManager."""

    def __init__(self, model_path: str, forward_setups: bool,
                 setups_from_workers: bool = False) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenize, self.detokenize = TokenizeManager(tokenizer), DetokenizeManager(tokenizer)
        self.forward_setups = forward_setups
        # tokens that came before their setup; only a detokenizer fed by workers waits for one
        self.setups_from_workers = setups_from_workers
        self.early: dict[int, list[DetokenizeMsg]] = defaultdict(list)

    def handle(self, msgs: list[TokenizerItem]
               ) -> tuple[list[BackendItem], list[FrontendItem], list[DetokenizeSetupMsg]]:
        """Messages for the scheduler, replies for the API server, setups to forward."""
        to_scheduler: list[BackendItem] = []
        replies: list[FrontendItem] = []
        setups: list[DetokenizeSetupMsg] = []
        for msg in msgs:
            if isinstance(msg, TokenizeMsg):
                try:
                    ids = self.tokenize.tokenize(msg)
                except Exception as e:  # a bad prompt or a chat the template rejects: answered
                    # here, the scheduler never sees it, and the process goes on serving
                    error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                    replies.append(UserReply(msg.uid, incremental_output="", finished=True,
                                             finish_reason="error", error=error))
                    continue
                setups.append(DetokenizeSetupMsg(msg.uid, len(ids), msg.stop))
                to_scheduler.append(UserMsg(msg.uid, ids, msg.sampling_params, msg.cache_salt))
            elif isinstance(msg, AbortMsg):
                to_scheduler.append(AbortBackendMsg(msg.uid))
            elif isinstance(msg, DetokenizeSetupMsg):
                setups.append(msg)
            elif isinstance(msg, StatsMsg):  # passed through, both ways
                to_scheduler.append(msg)
            elif isinstance(msg, StatsReply):
                replies.append(msg)
            else:
                self.early[msg.uid].append(msg)
        if not self.forward_setups:
            for s in setups:
                self.detokenize.add(s.uid, s.prompt_tokens, s.stop)
            setups = []
        # tokens are read in arrival order, each request's only once its setup is known
        for uid in [u for u in self.early if u in self.detokenize.status]:
            for token in self.early.pop(uid):
                reply, abort = self.detokenize.detokenize(token)
                replies += [reply] if reply is not None else []
                to_scheduler += [AbortBackendMsg(uid)] if abort else []
        if not self.setups_from_workers:  # every setup was made here: the rest are strays for
            self.early.clear()            # requests already answered, and nothing will claim them
        return to_scheduler, replies, setups


def tokenizer_worker(model_path: str, inbox: str, bind_inbox: bool, backend: str, frontend: str,
                     detokenizer: str | None = None, ready: Connection | None = None,
                     has_workers: bool = False) -> None:
    """The process's main: serve until SIGTERM. `detokenizer` is the detokenizer's address
    for a worker, None for the process that detokenizes (the only one by default);
    `has_workers` tells that process that setups come from workers."""
    exit_on_sigterm()  # unwinds the with statement: the sockets are closed
    server = TokenizerServer(model_path, forward_setups=detokenizer is not None,
                             setups_from_workers=has_workers)
    with ExitStack() as sockets:  # closed however the loop ends
        pull: ZmqPullQueue[TokenizerMsg] = sockets.enter_context(
            ZmqPullQueue(inbox, bind=bind_inbox, expected=TokenizerMsg))
        to_backend = sockets.enter_context(ZmqPushQueue[BatchBackendMsg](backend, bind=False))
        to_frontend = sockets.enter_context(ZmqPushQueue[BatchFrontendMsg](frontend, bind=False))
        to_detok = (sockets.enter_context(ZmqPushQueue[BatchTokenizerMsg](detokenizer, bind=False))
                    if detokenizer else None)
        if ready is not None:
            ready.send("tokenizer")
        while True:
            pump(server, pull, to_backend=to_backend, to_frontend=to_frontend, to_detok=to_detok)


def pump(server: TokenizerServer, pull: ZmqPullQueue[TokenizerMsg],
         to_backend: ZmqPushQueue[BatchBackendMsg], to_frontend: ZmqPushQueue[BatchFrontendMsg],
         to_detok: ZmqPushQueue[BatchTokenizerMsg] | None) -> None:
    """One wake-up: the next frame only (one request from the API server, or one step's tokens
    from the scheduler), handled and sent on at once. So a burst of requests reaches the
    scheduler one by one, and a step's tokens wait behind at most one request's tokenization
    (draining every queued frame first made the first of 64 requests wait for the
    tokenization of all 64)."""
    to_scheduler, replies, setups = server.handle(_unbatch(pull.get()))
    if to_detok is not None and setups:  # sent before the requests go on, as a rule
        to_detok.put(BatchTokenizerMsg(list(setups)))
    if to_scheduler:
        to_backend.put(BatchBackendMsg(to_scheduler))
    if replies:
        to_frontend.put(BatchFrontendMsg(replies))


def _unbatch(msg: TokenizerMsg | None) -> list[TokenizerItem]:
    if msg is None:
        return []
    return list(msg.data) if isinstance(msg, BatchTokenizerMsg) else [msg]
