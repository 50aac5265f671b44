"""The server on CUDA (chapters 15, 17, 18): `python -m minisgl --attn auto` serving the
Qwen3-0.6B-shaped model answers one streamed chat completion through the openai client, then
stops on SIGTERM with none of its processes left. tools/gpu_tp.py makes the same run at --tp 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_common import run_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (none on this machine)")]


def test_server_streams_a_chat_and_stops_clean(q06: Path, tmp_path: Path) -> None:
    run = run_server(q06, log_dir=tmp_path)
    about = (f"{' '.join(run.command[1:])}: ready after {run.ready_s:.0f} s; its log: "
             f"{run.log_lines}")
    assert run.streamed_to_length, (
        f"the stream ended with finish_reason {run.finish_reason!r}, not 'length', after "
        f"{run.chunks} chunks; text (random weights) {run.text[:60]!r}; {about}")
    assert run.exit_code == 0, f"exit code {run.exit_code} after SIGTERM; {about}"
    assert run.left_running == 0, (f"{run.left_running} of its {run.children} child processes "
                                   f"were still running 10 s after it exited; {about}")
