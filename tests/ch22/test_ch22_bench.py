"""Chapter 22's GPU comparison, run small on the CPU: benchmark/eos_model.py gives a random-weight
model an EOS token that ends about half its outputs (a token its weights emit, its LM-head row
scaled), and benchmark/bench_offline.py --eos runs greedy requests that stop there, ours by
expected need beside ours conservatively, on one small pool."""

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
    tool = runpy.run_path(str(FOLDER / "eos_model.py"))
    choose, bisect = tool["choose"], tool["bisect"]
    # 9 is in all four after position 0; 5 and 6 start outputs (they would end them empty)
    assert choose([[5, 7, 9, 1], [5, 9, 7, 2], [6, 9, 3, 3], [5, 2, 9, 8]], 1) == (9, [2, 1, 1, 2])
    # all of 2..5 end both outputs: the target picks the one whose stop is nearest
    assert choose([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], 3)[0] == 4
    with pytest.raises(SystemExit, match="probe more"):
        choose([[1], [1]], 1)
    # only ids in [low, high): 9 is below, 7 is the one left that never starts an output
    assert choose([[5, 7, 9, 1], [5, 9, 7, 2]], 1, low=6, high=9)[0] == 7
    # the factor: doubled until the median stop is at or below the target, then halved between
    factor, median = bisect(lambda f: 100 / f, 10, 6)
    assert abs(factor - 10) < 0.2 and abs(median - 10) < 0.2
    assert bisect(lambda f: 3.0, 10, 6) == (1.0, 3.0)  # already below: no scaling


def test_both_admissions_stop_at_the_new_eos_with_the_same_tokens(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model, out = tmp_path / "eos", tmp_path / "offline.json"
    made = subprocess.run([sys.executable, str(FOLDER / "eos_model.py"), "--model",
                           str(model_dir("tiny-qwen3")), "--out", str(model), *WORKLOAD,
                           "--probe", "64", "--target", "16"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    found = re.search(r"EOS is now token (\d+).* ends (\d+) of 32 outputs", made.stdout)
    assert found, made.stdout[-2000:]
    token, ended = map(int, found.groups())
    assert AutoTokenizer.from_pretrained(model).eos_token_id == token
    assert ended >= 17, made.stdout  # a finite median stop (near --target 16): most end early
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
