"""The tokenizer process and its two managers (chapter 13)."""

from .detokenize import DetokenizeManager
from .server import tokenizer_worker
from .tokenize import TokenizeManager

__all__ = ["DetokenizeManager", "TokenizeManager", "tokenizer_worker"]
