"""The messages between the server's processes and their encoding (chapter 12)."""

from .backend import AbortBackendMsg, BackendMsg, BatchBackendMsg, ExitMsg, StatsMsg, UserMsg
from .codec import MessageError, decode, encode, message
from .frontend import BatchFrontendMsg, FinishOrError, FrontendMsg, StatsReply, UserReply
from .tokenizer import (
    AbortMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    DetokenizeSetupMsg,
    TokenizeMsg,
    TokenizerMsg,
)

__all__ = [
    "AbortBackendMsg", "AbortMsg", "BackendMsg", "BatchBackendMsg", "BatchFrontendMsg",
    "BatchTokenizerMsg", "DetokenizeMsg", "DetokenizeSetupMsg", "ExitMsg", "FinishOrError",
    "FrontendMsg", "MessageError", "StatsMsg", "StatsReply", "TokenizeMsg", "TokenizerMsg",
    "UserMsg", "UserReply", "decode", "encode", "message",
]
