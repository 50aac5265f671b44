"""What the scheduler's managers pass around: queued requests, replies, counters (chapter 7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl.core import FinishReason, SamplingParams

if TYPE_CHECKING:
    from .prefill import ChunkedReq


@dataclass
class PendingReq:
    """A request waiting for its (next) prefill: not yet holding a table row or KV pages,
    except a chunked one, which keeps the row and pages of the chunks already computed."""

    uid: int
    input_ids: torch.Tensor  # int32 on the CPU: the whole prompt
    sampling_params: SamplingParams
    chunked_req: ChunkedReq | None = None  # while the prompt is prefilled in parts
    cache_salt: str = ""  # shares cached prefixes only with the same salt

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        return self.sampling_params.max_tokens


class TokenReply(NamedTuple):
    """One sampled token of one request, handed to whoever waits for it."""

    uid: int
    next_token: int  # -1 when there is none (an aborted request)
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass
class SchedulerStats:
    """Counted by the scheduler itself, so claims about saved work are measured."""

    prefill_batches: int = 0
    decode_batches: int = 0
    prefill_tokens: int = 0  # prompt tokens computed by prefill batches
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead
