"""benchmark/prepare_cost.py on the CPU: two engines (both ours here), rounds in turns, each run's
preparation and launch timed and the preparation profiled."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from benchmarks import FOLDER, load


def test_runs_in_turns_and_profiles_the_preparation(model_dir: Callable[[str], Path],
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    prepare_cost = load("prepare_cost")
    package = str(FOLDER.parent / "python") if (FOLDER.parent / "python").is_dir() else str(
        FOLDER.parent)  # the repository's python/, or a chapter tree (minisgl/ at its root)
    out = tmp_path / "runs.json"
    prepare_cost.main(["--model", str(model_dir("tiny-qwen3")), "--engine", f"a={package}",
                       "--engine", f"b={package}", "--rounds", "2", "--prompts", "3",
                       "--tokens", "40", "--pages", "2000", "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["engine"], r["round"]) for r in runs] == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    for r in runs:
        assert r["prepare"]["n"] == r["launch"]["n"] == 3  # one prefill per prompt
        assert 0 < r["prepare"]["min"] <= r["prepare"]["p50"] <= r["prepare"]["max"]
        assert any("_prepare_batch" in row["function"] for row in r["profile"])
    assert "a: prepare p50 per run" in capsys.readouterr().out
