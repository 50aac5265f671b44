"""How each of the server's processes leaves on SIGTERM (chapter 21): once, cleanly."""

from __future__ import annotations

import signal


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(0), so the process unwinds: its finally clauses and with
    statements run (the scheduler shuts its engine down, the sockets close), then its exit
    handlers. A second SIGTERM while it does so (the launcher's after the process group's, say)
    is ignored: raised again it would cut that clean-up short, in the middle of whatever step
    it had reached."""
    signal.signal(signal.SIGTERM, _exit_once)


def _exit_once(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)
