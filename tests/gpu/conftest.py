"""Fixtures of the GPU tests (issue "14 ·"): the models they run and chapter 6's HandBatcher.

Every test here is marked `gpu` and skips on a machine without CUDA before any fixture runs, so
`make test` on a CPU only collects them; the exception is test_gpu_moe.py's MoE checks in
Triton's interpreter, which run there instead (a few seconds). On a GPU machine:

    python tools/models.py tiny                     # models/tiny-*, or the tests using them skip
    python -m pytest -m gpu tests/gpu               # MINISGL_Q06, MINISGL_MOE: see below

What they share with benchmark/gpu_bench.py and tools/gpu_tp.py is in tools/gpu_common.py,
put on sys.path here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "tools"))  # gpu_common


def _make(path: Path, *args: str) -> Path:
    """`path`, made by `tools/models.py random *args --out path` on CUDA when it holds no model."""
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "tools" / "models.py"), "random", *args,
                        "--out", str(path), "--device", "cuda"], check=True)
    return path


@pytest.fixture(scope="session")
def tiny() -> Callable[[str], Path]:
    """tiny(name) -> models/<name>; the test skips, naming the command, when it is not made."""

    def find(name: str) -> Path:
        path = ROOT / "models" / name
        if not (path / ".minisgl-made").is_file():
            pytest.skip(f"{path} is not made: python tools/models.py tiny {name}")
        return path

    return find


@pytest.fixture(scope="session")
def q06() -> Path:
    """A Qwen3-0.6B-shaped model with random weights, bfloat16: $MINISGL_Q06 (default /tmp/q06),
    made there by tools/models.py when missing (a minute or two)."""
    path = Path(os.environ.get("MINISGL_Q06", "/tmp/q06"))
    return _make(path, "--arch", "qwen3", "--preset", "0.6b", "--dtype", "bfloat16")


@pytest.fixture
def model_path(request: pytest.FixtureRequest, tiny: Callable[[str], Path]
               ) -> Callable[[str], Path]:
    """model_path(name) -> tiny(name), or the q06 model for "q06" (made only when asked for)."""
    return lambda name: request.getfixturevalue("q06") if name == "q06" else tiny(name)


@pytest.fixture(scope="session")
def moe_model(tiny: Callable[[str], Path]) -> Path:
    """$MINISGL_MOE, a Qwen3-MoE model, made there with the 30b-a3b preset when missing (on the
    H200: `tools/models.py random --arch qwen3-moe --preset 30b-a3b --layers 4 --out /tmp/moe`);
    models/tiny-qwen3-moe when the variable is not set."""
    if "MINISGL_MOE" not in os.environ:
        return tiny("tiny-qwen3-moe")
    return _make(Path(os.environ["MINISGL_MOE"]), "--arch", "qwen3-moe", "--preset", "30b-a3b")


@pytest.fixture(scope="session")
def hand_batcher(pytestconfig: pytest.Config) -> type:
    """Chapter 6's HandBatcher (chapters/ch06_engine/skeleton.py), loaded by tests/conftest.py's
    chapter_module. That conftest is found among pytest's plugins: `from conftest import` would
    get this one, which shares its module name."""
    top = [p for p in pytestconfig.pluginmanager.get_plugins() if hasattr(p, "chapter_module")]
    assert len(top) == 1, f"{len(top)} plugins define chapter_module (tests/conftest.py does)"
    return top[0].chapter_module("ch06_engine", "skeleton").HandBatcher
