"""The messages between the server's processes and their encoding (chapter 12)."""

from .backend import (
    AbortBackendMsg,
    BackendItem,
    BackendMsg,
    BatchBackendMsg,
    ExitMsg,
    StatsMsg,
    UserMsg,
)
from .codec import MessageError, decode, encode, message
from .frontend import (
    BatchFrontendMsg,
    FinishOrError,
    FrontendItem,
    FrontendMsg,
    StatsReply,
    UserReply,
)
from .tokenizer import (
    AbortMsg,
    BatchTokenizerMsg,
    DetokenizeMsg,
    DetokenizeSetupMsg,
    TokenizeMsg,
    TokenizerItem,
    TokenizerMsg,
)

__all__ = [
    "AbortBackendMsg", "AbortMsg", "BackendItem", "BackendMsg", "BatchBackendMsg",
    "BatchFrontendMsg", "BatchTokenizerMsg", "DetokenizeMsg", "DetokenizeSetupMsg", "ExitMsg",
    "FinishOrError", "FrontendItem", "FrontendMsg", "MessageError", "StatsMsg", "StatsReply",
    "TokenizeMsg", "TokenizerItem", "TokenizerMsg", "UserMsg", "UserReply", "decode", "encode",
    "message",
]
