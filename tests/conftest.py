"""Shared pytest fixtures: where the test models live and how they get made (chapter 0).

This file never imports minisgl: it is part of every chapter's tree, including chapter 0's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# `tools/steps.py` runs a chapter's tests in a temporary tree and tells us where the repo is.
REPO = Path(os.environ.get("MINISGL_REPO") or Path(__file__).resolve().parents[1])
MODELS = REPO / "models"
SMOLLM2 = "SmolLM2-135M-Instruct"


def ensure_model(name: str) -> Path:
    """Return models/<name>, making it with tools/models.py first if it is not there."""
    folder = MODELS / name
    if not (folder / ".minisgl-made").is_file():
        args = ["smollm2"] if name == SMOLLM2 else ["tiny", name]
        subprocess.run([sys.executable, str(REPO / "tools" / "models.py"), *args], check=True)
    return folder


@pytest.fixture(scope="session")
def model_dir() -> Callable[[str], Path]:
    """`model_dir("tiny-qwen3")` -> the folder, made on first use and cached between runs."""
    return ensure_model
