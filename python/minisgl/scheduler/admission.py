"""Admission by expected need (chapter 22): a running request is expected to use only part of
the output it may still produce, and the KV tokens promised to it shrink to that part. When the
guess proves too low the scheduler retracts requests; the ratio learns from it. SGLang's numbers
(its environment defaults SGLANG_INIT_NEW_TOKEN_RATIO and neighbours)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from minisgl.core import Req

ADMISSION_MODES = ("expected", "conservative")
INIT_NEW_TOKEN_RATIO = 0.7  # the share of its remaining output a request is expected to use
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # the floor, as a share of the initial ratio
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps from the initial ratio down to the floor
RETRACT_DECODE_STEPS = 20  # after a retraction: each survivor is expected to run this many more
CLIP_MAX_NEW_TOKENS = 4096  # no request is expected to need more output tokens than this


def admission_error(mode: str, conservativeness: float,
                    names: tuple[str, str] = ("admission", "schedule_conservativeness"),
                    ) -> str | None:
    """Why these admission settings cannot work, or None; says what to use instead. `names`:
    what the caller calls the two settings (keywords, or the server's flags)."""
    if mode not in ADMISSION_MODES:
        return (f"{names[0]} must be 'expected' (reserve the output a request is expected to "
                f"use, retract under pressure) or 'conservative' (reserve all of max_tokens, "
                f"never retract), not {mode!r}")
    if not (math.isfinite(conservativeness) and conservativeness > 0):
        return (f"{names[1]} must be a number above 0 (1.0 is the default; raise it if "
                f"requests are retracted often), not {conservativeness!r}")
    return None


def prompt_len(req: Req) -> int:
    """The client's prompt: a retracted request's input ends with the tokens it generated,
    and its output budget is what was left of max_tokens, so both add up to the original."""
    return req.max_device_len - req.sampling_params.max_tokens


def generated_len(req: Req) -> int:
    """Output tokens of the request on the host so far (with overlap, not the one in flight)."""
    return req.host_len - prompt_len(req)


class NewTokenRatio:
    """The share of their remaining output that running requests are expected to still need.
    It starts at min(0.7 * conservativeness, 1), falls linearly by (start - floor) / 600 per
    decode step without a retraction to a floor of 0.14 * start, rises after a retraction to
    what the survivors suggest (never lower: a retraction says the guess was too low), and
    starts over when the scheduler is idle."""

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.floor = MIN_NEW_TOKEN_RATIO_FACTOR * self.init
        self.step = (self.init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay(self) -> None:
        """A decode step that needed no retraction: guess a little lower."""
        self.value = max(self.value - self.step, self.floor)

    def reset(self) -> None:
        self.value = self.init

    def after_retraction(self, survivors: Sequence[Req]) -> None:
        """(output so far + 20 more each) / max_tokens, over the requests still running: what
        they will have used by then, as a share of what they may use."""
        done = sum(generated_len(r) for r in survivors)
        budget = sum(r.sampling_params.max_tokens for r in survivors)
        estimate = min(1.0, (done + RETRACT_DECODE_STEPS * len(survivors)) / (budget + 1))
        self.value = max(self.value, estimate)

    def expected_need(self, req: Req) -> int:
        """KV tokens a running request is expected to still need: its remaining output (at most
        CLIP_MAX_NEW_TOKENS) times the ratio, or all of it when it ignores EOS (its output length
        is known)."""
        ratio = 1.0 if req.sampling_params.ignore_eos else self.value
        return math.ceil(min(req.remain_len, CLIP_MAX_NEW_TOKENS) * ratio)


def retraction_order(reqs: Sequence[Req]) -> list[Req]:
    """The running requests, the first to retract first: the fewest output tokens (the least
    work lost), then the longest prompt (the most pages freed), then the newest (highest uid).
    A total order on values every tensor-parallel rank has alike."""
    return sorted(reqs, key=lambda r: (generated_len(r), -prompt_len(r), -r.uid))
