"""Messages to the API server, from the tokenizer (chapter 12)."""

from __future__ import annotations

from dataclasses import dataclass

from .codec import message


@message
@dataclass
class UserReply:
    """New text of a request since the last reply. The last reply has `finished` set, a
    `finish_reason` ("stop", "length" or "error", with `error` then saying why) and the token
    counts that the response's `usage` reports."""

    uid: int
    incremental_output: str
    finished: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@message
@dataclass
class BatchFrontendMsg:
    data: list[UserReply]


FrontendMsg = UserReply | BatchFrontendMsg
