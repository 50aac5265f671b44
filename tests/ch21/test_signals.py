"""SIGTERM ends a server process once: a second one that arrives while it unwinds (the launcher's
after the process group's) must not cut its clean-up short. Before, each process raised
SystemExit on every SIGTERM, and a second one inside an exit handler left a traceback and the
handler unfinished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minisgl.utils.signals import exit_on_sigterm

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import atexit, os, signal, sys, time
    from minisgl.utils.signals import exit_on_sigterm

    def cleanup():  # a slow exit handler (torch's, say) that a second SIGTERM lands in
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("cleanup finished", flush=True)

    exit_on_sigterm()
    atexit.register(cleanup)
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # a second one while the finally clause runs
        time.sleep(0.2)
        print("finally finished", flush=True)
""")


def test_a_second_sigterm_does_not_cut_the_clean_up_short() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    time.sleep(0.1)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    assert out.splitlines() == ["finally finished", "cleanup finished"], (out, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_the_first_sigterm_raises_system_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        exit_on_sigterm()
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(SystemExit) as exit_info:
            handler(signal.SIGTERM, None)
        assert exit_info.value.code == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # the next one is ignored
    finally:
        signal.signal(signal.SIGTERM, previous)
