"""SchedulerConfig: the Engine's config plus how to schedule (chapter 7)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"  # prefix cache: "radix" or "naive"
    max_extend_tokens: int = 8192  # prompt tokens one prefill batch may compute

    def __post_init__(self) -> None:
        if self.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be at least 1, not {self.max_extend_tokens}")
