"""Messages to the tokenizer process (chapter 12): from the API server (text in) and from the
scheduler (token ids out)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.core import SamplingParams

from .backend import StatsMsg
from .codec import message
from .frontend import FinishOrError, StatsReply


@message
@dataclass
class TokenizeMsg:
    """A new request from the API server. `prompt` is plain text, a chat (a list of
    {"role", "content"} messages, templated with add_generation_prompt), or token ids."""

    uid: int
    prompt: str | list[dict[str, str]] | list[int]
    sampling_params: SamplingParams
    stop: list[str]  # cut the output before the first of these strings
    cache_salt: str = ""  # shares cached prefixes only with the same salt


@message
@dataclass
class DetokenizeMsg:
    """One sampled token of a request, from the scheduler. `finish_reason` is set on the last
    one: "stop" (EOS), "length" (max_tokens or the context is full), "abort", or
    "error" with `error` saying why the request could not run (then `next_token` is -1)."""

    uid: int
    next_token: int
    finished: bool
    finish_reason: FinishOrError | None = None
    error: str | None = None


@message
@dataclass
class DetokenizeSetupMsg:
    """From a tokenizer worker to the detokenizer (with --num-tokenizer N > 0, they are
    different processes): what it needs to know of a new request before its first token."""

    uid: int
    prompt_tokens: int
    stop: list[str]


@message
@dataclass
class AbortMsg:
    """The API server gave up on a request (its client went away)."""

    uid: int


@message
@dataclass
class BatchTokenizerMsg:
    """Several messages in one frame: one send and one wake-up for a whole step's tokens."""

    data: list[TokenizerItem]


# StatsMsg and StatsReply pass through the tokenizer: API server -> scheduler -> API server
TokenizerItem = TokenizeMsg | DetokenizeMsg | DetokenizeSetupMsg | AbortMsg | StatsMsg | StatsReply
"""One message to the tokenizer; a BatchTokenizerMsg carries a list of them."""
TokenizerMsg = TokenizerItem | BatchTokenizerMsg
