"""Messages to the API server, from the tokenizer (chapter 12)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from minisgl.core import FinishReason

from .codec import message

FinishOrError = FinishReason | Literal["error"]
"""How a request's last reply ends: a FinishReason, or "error" when it could not run."""


@message
@dataclass
class UserReply:
    """New text of a request since the last reply. The last reply has `finished` set, a
    `finish_reason` ("stop", "length", "abort", or "error", with `error`
    then saying why) and the token counts that the response's `usage` reports."""

    uid: int
    incremental_output: str
    finished: bool
    finish_reason: FinishOrError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@message
@dataclass
class StatsReply:
    """The scheduler's answer to a StatsMsg. `idle`: nothing waiting, running or in
    flight; then `integrity` says whether every table row and KV page is back ("ok", or the
    error the scheduler's own check raised). `aborted`: requests ended by an abort so far."""

    uid: int
    idle: bool
    aborted: int
    waiting: int
    running: int
    free_rows: int
    total_rows: int
    free_pages: int
    total_pages: int
    integrity: str | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache so far
    retractions: int = 0  # times running requests were retracted to make room for a decode
    retracted_reqs: int = 0  # requests retracted so far
    recomputed_tokens: int = 0  # tokens prefilled again after retractions
    new_token_ratio: float = 1.0  # share of their output running requests are expected to use


@message
@dataclass
class BatchFrontendMsg:
    data: list[FrontendItem]


FrontendItem = UserReply | StatsReply
"""One message to the API server; a BatchFrontendMsg carries a list of them."""
FrontendMsg = FrontendItem | BatchFrontendMsg
