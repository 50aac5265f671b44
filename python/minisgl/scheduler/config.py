"""SchedulerConfig: the Engine's config plus how to schedule (chapter 7)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig

from .admission import admission_error


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"  # prefix cache: "radix" or "naive"
    max_extend_tokens: int = 8192  # prompt tokens one prefill batch may compute
    # the same while running streams wait for their next token (0: max_extend_tokens); the
    # server's streams get a decode step between such prefill steps
    streaming_extend_tokens: int = 0
    # "expected": running requests keep the output they are expected to use, and are retracted
    # when that proves too little; "conservative": they keep all of it, and never are
    admission: str = "expected"
    schedule_conservativeness: float = 1.0  # higher: expect more output, retract less

    def __post_init__(self) -> None:
        if self.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be at least 1, not {self.max_extend_tokens}")
        if self.streaming_extend_tokens < 0:
            raise ValueError("streaming_extend_tokens must be 0 (the same as max_extend_tokens) "
                             f"or more, not {self.streaming_extend_tokens}")
        if (error := admission_error(self.admission, self.schedule_conservativeness)) is not None:
            raise ValueError(error)
