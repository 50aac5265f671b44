"""SchedulerConfig: the Engine's config plus how to schedule (chapter 7)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig(EngineConfig):
    """Nothing of its own yet: the prefix cache type (chapter 9) and the prefill token budget
    (chapter 10) join here."""
