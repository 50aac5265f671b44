"""Chapter 21: benchmark/bench_offline.py, the offline benchmark: nano-vllm's workload drawn the
same way (its README's total is the check), and the driver run for real on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks import FOLDER, load

BENCH = FOLDER / "bench_offline.py"


def test_the_workload_is_nano_vllms() -> None:
    """nano-vllm's README reports 133,966 output tokens for its bench.py (256 requests, seed 0):
    a figure computed elsewhere, which only the same draws in the same order give."""
    prompts, lens = load("bench_offline").workload(256, (100, 1024), (100, 1024))
    assert sum(lens) == 133_966
    assert len(prompts) == 256 and all(100 <= len(p) <= 1024 for p in prompts)
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_the_driver_runs_each_configuration_in_its_own_process(
        model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Two of our configurations side by side on tiny-qwen3: every asked token is generated and
    counted, the step is measured, the rows and the JSON say what ran."""
    out = tmp_path / "offline.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--model", str(model_dir("tiny-qwen3")), "--requests", "4",
         "--max-id", "500", "--input-len", "8", "24", "--output-len", "4", "12", "--rounds", "2",
         "--latency", "--group", "ours:torch:eager:on", "ours:torch:eager:off", "--json",
         str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    asked = result["workload"]["asked"]["nano"]
    assert [r["config"] for r in result["rows"]] == ["ours:torch:eager:on", "ours:torch:eager:off"]
    for row in result["rows"]:
        assert row["output_tokens"] == asked  # ignore_eos: every asked token is there
        assert len(row["seconds_all"]) == 2
        for rate, seconds in zip(row["tok_s_all"], row["seconds_all"]):
            assert abs(rate - asked / seconds) <= 0.01 * rate  # seconds_all are rounded
        assert abs(row["tok_s"] - sum(row["tok_s_all"]) / 2) <= 0.1  # the median of two
        assert 0 < row["step_ms_p50"] < row["seconds"] * 1e3
        assert row["latency"]["runs"] == 2 and row["latency"]["step_ms"] > 0
        assert row["versions"]["minisgl"].startswith("ours")
    assert "ours:torch:eager:off" in done.stdout and result["bench"] == "offline"


def test_our_workloads_have_the_shapes_they_claim() -> None:
    """Each of chapter 21's own workloads, drawn at full size: the prefix one shares 8 prefixes
    of 1-2k tokens among 384 requests, the long one is 4-8k prompts, the short one runs more
    requests than the largest CUDA graph (256), and every round draws new prompts."""
    bench = load("bench_offline")
    prompts, lens = bench.shaped(bench.WORKLOADS["prefix"], seed=1)
    heads = {tuple(p[:1024]) for p in prompts}
    assert len(prompts) == 384 and len(heads) == 8
    assert all(64 <= k <= 256 for k in lens)
    prompts, lens = bench.shaped(bench.WORKLOADS["long"], seed=1)
    assert len(prompts) == 40 and all(4096 <= len(p) <= 8192 for p in prompts)
    prompts, lens = bench.shaped(bench.WORKLOADS["short"], seed=1)
    assert len(prompts) == 1024 > 256 and max(map(len, prompts)) <= 128
    again, _ = bench.shaped(bench.WORKLOADS["short"], seed=2)
    assert again != prompts  # a new draw per round: no prefix cached in one round helps the next
    small, _ = bench.shaped(bench.WORKLOADS["mixed"], scale=0.02, seed=1)
    assert 0 < len(small) < 20 and max(map(len, small)) <= 8192 * 0.02 + 1
