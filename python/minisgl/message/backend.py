"""Messages to the scheduler process, from the tokenizer (chapter 12)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import SamplingParams

from .codec import message

message(SamplingParams)  # travels inside UserMsg and TokenizeMsg


@message
@dataclass
class UserMsg:
    """A tokenized request: its prompt as a 1-D int32 CPU tensor."""

    uid: int
    input_ids: torch.Tensor
    sampling_params: SamplingParams
    cache_salt: str = ""  # shares cached prefixes only with the same salt


@message
@dataclass
class AbortBackendMsg:
    """Stop a request wherever it is and give back its table row and KV pages."""

    uid: int


@message
@dataclass
class StatsMsg:
    """Ask the scheduler how it stands: it answers with a StatsReply of this uid,
    which the tokenizer passes on to the API server."""

    uid: int


@message
@dataclass
class ExitMsg:
    """Leave the loop and shut down."""


@message
@dataclass
class BatchBackendMsg:
    data: list[BackendItem]


BackendItem = UserMsg | AbortBackendMsg | StatsMsg | ExitMsg
"""One message to the scheduler; a BatchBackendMsg carries a list of them."""
BackendMsg = BackendItem | BatchBackendMsg
