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
    except a chunked one, which keeps the row and pages of the chunks already computed. A
    retracted request waits here again: its input is its prompt and the tokens it generated
    (computed again, mostly found in the prefix cache), its output what is left of max_tokens."""

    uid: int
    input_ids: torch.Tensor  # int32 on the CPU: the whole prompt (+ output before a retraction)
    sampling_params: SamplingParams
    chunked_req: ChunkedReq | None = None  # while the prompt is prefilled in parts
    cache_salt: str = ""  # shares cached prefixes only with the same salt
    generated: int = 0  # the last tokens of input_ids that it generated before a retraction
    retractions: int = 0  # times it was retracted

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def output_len(self) -> int:
        """Output tokens still to come: max_tokens, less any generated before a retraction."""
        return self.sampling_params.max_tokens - self.generated


class TokenReply(NamedTuple):
    """One sampled token of one request, handed to whoever waits for it."""

    uid: int
    next_token: int  # -1 when there is none (an aborted request)
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None  # why the request could not go on (then finish_reason is "abort")


@dataclass
class SchedulerStats:
    """Counted by the scheduler itself, so claims about saved work are measured."""

    prefill_batches: int = 0
    decode_batches: int = 0
    prefill_tokens: int = 0  # tokens computed by prefill batches (recomputed ones included)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead
    retractions: int = 0  # times requests were retracted to make room for a decode step
    retracted_reqs: int = 0  # requests retracted (one retracted twice counts twice)
    recomputed_tokens: int = 0  # tokens prefilled again after a retraction
