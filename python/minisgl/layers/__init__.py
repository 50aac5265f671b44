"""Layers built from BaseOP; AttentionLayer lives in layers/attention.py (chapter 2)."""

from .activation import silu_and_mul
from .base import BaseOP, OPList, StateLessOP
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearReplicated,
    LinearRowParallel,
)
from .norm import RMSNorm, RMSNormFused
from .rotary import RotaryEmbedding

__all__ = [
    "BaseOP",
    "LinearColParallelMerged",
    "LinearOProj",
    "LinearQKVMerged",
    "LinearReplicated",
    "LinearRowParallel",
    "OPList",
    "ParallelLMHead",
    "RMSNorm",
    "RMSNormFused",
    "RotaryEmbedding",
    "StateLessOP",
    "VocabParallelEmbedding",
    "silu_and_mul",
]
