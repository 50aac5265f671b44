"""The scheduler: queued requests in, batches through the Engine, tokens out (chapter 7)."""

from .config import SchedulerConfig
from .scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig"]
