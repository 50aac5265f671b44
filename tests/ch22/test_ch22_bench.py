"""Chapter 22's H200 comparison, run small on the CPU: benchmark/eos_model.py gives a random-weight
model an EOS token its weights do emit, and benchmark/bench_offline.py --eos runs greedy requests
that stop there, ours by expected need beside ours conservatively, on one small pool."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

FOLDER = Path(__file__).resolve().parents[2] / "benchmark"
WORKLOAD = ["--requests", "32", "--input-len", "8", "32", "--output-len", "64", "128",
            "--max-id", "400"]


def test_the_eos_is_the_token_that_ends_the_most_outputs() -> None:
    choose = runpy.run_path(str(FOLDER / "eos_model.py"))["choose"]
    # 9 is in all four after position 0; 5 and 6 start outputs (they would end them empty)
    assert choose([[5, 7, 9, 1], [5, 9, 7, 2], [6, 9, 3, 3], [5, 2, 9, 8]], 1) == (9, [2, 1, 1, 2])
    # all of 2..5 end both outputs: the target picks the one whose stop is nearest
    assert choose([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], 3)[0] == 4
    with pytest.raises(SystemExit, match="probe more"):
        choose([[1], [1]], 1)


def test_both_admissions_stop_at_the_new_eos_with_the_same_tokens(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model, out = tmp_path / "eos", tmp_path / "offline.json"
    made = subprocess.run([sys.executable, str(FOLDER / "eos_model.py"), "--model",
                           str(model_dir("tiny-qwen3")), "--out", str(model), *WORKLOAD,
                           "--probe", "64", "--target", "16"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    token = int(re.search(r"EOS is now token (\d+)", made.stdout).group(1))  # type: ignore[union-attr]
    assert AutoTokenizer.from_pretrained(model).eos_token_id == token
    configs = ["ours:torch:eager:on", "ours:torch:eager:on:conservative"]
    ran = subprocess.run([sys.executable, str(FOLDER / "bench_offline.py"), "--model", str(model),
                          *WORKLOAD, "--eos", "--pool", "700", "--rounds", "1", "--group",
                          *configs, "--json", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == configs
    tokens = {r["output_tokens"] for r in rows.values()}
    assert len(tokens) == 1 and tokens.pop() < result["workload"]["asked"]["nano"]  # EOS ended some
    # by expected need more requests run at once on the same pool: fewer batches
    assert rows[configs[0]]["steps_all"][0] < rows[configs[1]]["steps_all"][0]
