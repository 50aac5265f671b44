"""SchedulerConfig: the Engine's config plus how to schedule (chapter 7)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"  # prefix cache: "radix" or "naive" (chapter 9)
