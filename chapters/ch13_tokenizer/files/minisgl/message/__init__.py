"""The messages between the server's processes and their encoding (chapter 12)."""

from .backend import AbortBackendMsg, BackendMsg, BatchBackendMsg, ExitMsg, UserMsg
from .codec import MessageError, decode, encode, message
from .frontend import BatchFrontendMsg, FrontendMsg, UserReply
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
    "BatchTokenizerMsg", "DetokenizeMsg", "DetokenizeSetupMsg", "ExitMsg", "FrontendMsg",
    "MessageError", "TokenizeMsg", "TokenizerMsg", "UserMsg", "UserReply", "decode", "encode",
    "message",
]
