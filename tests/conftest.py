"""Shared pytest fixtures: where the test models live and how they get made, and how to load
a chapter's own modules (naive.py, skeleton.py) (chapter 0).

This file never imports minisgl at import time: it is part of every chapter's tree, including
chapter 0's. The `make_llm` fixture (chapters 7 on) imports it when a test asks for it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

# `tools/steps.py` runs a chapter's tests in a temporary tree and tells us where the repo is.
REPO = Path(os.environ.get("MINISGL_REPO") or Path(__file__).resolve().parents[1])
# LLM.generate walks every KV page once it is done, when asked to (it costs ~0.1 s per call at
# a GPU's pool size, so it is off unless asked): every test asks
os.environ.setdefault("MINISGL_CHECK_INTEGRITY", "1")
MODELS = REPO / "models"
SMOLLM2 = "SmolLM2-135M-Instruct"
# Inside a materialised chapter tree the chapter's own modules sit at the tree root; in the
# repository tools/steps.py's reader makes them from chapters/. This is the root of either.
HERE = Path(__file__).resolve().parents[1]
IN_TREE = not (HERE / "chapters").is_dir()
if not IN_TREE:
    sys.path.insert(0, str(HERE / "chapters" / "ch00_naive"))  # naive.py, used by chapter 1


def ensure_model(name: str) -> Path:
    """Return models/<name>, making it with tools/models.py first if it is not there."""
    folder = MODELS / name
    if not (folder / ".minisgl-made").is_file():
        args = ["smollm2"] if name == SMOLLM2 else ["tiny", name]
        subprocess.run([sys.executable, str(REPO / "tools" / "models.py"), *args], check=True)
    return folder


def chapter_module(chapter: str, name: str) -> ModuleType:
    """A chapter's own module (e.g. chapter "ch03_models", name "skeleton"), loaded under a
    name of its own so that several chapters' skeletons can live in one test session."""
    key = f"{chapter}_{name}"
    if key not in sys.modules:
        path = HERE / f"{name}.py" if IN_TREE else _chapter_file(chapter, f"{name}.py")
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _chapter_file(chapter: str, path: str) -> Path:
    """In the repository: chapter N's copy of a top-level file of its tree, written once under
    a temporary folder. The repository may store it as a delta against tree N+1's copy
    (chapters/chNN_slug/delta.patch), so tools/steps.py's reader makes it."""
    tools = str(HERE / "tools")
    sys.path.insert(0, tools)
    try:
        from book.manifest import Book
    finally:
        sys.path.remove(tools)
    book = Book(HERE)
    data = book.content_at(book.get(int(chapter[2:4])), path)
    if not _TREES:
        _TREES.append(Path(tempfile.mkdtemp(prefix="minisgl-chapters-")))
        atexit.register(shutil.rmtree, _TREES[0], True)
    dest = _TREES[0] / chapter / path
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return dest


_TREES: list[Path] = []  # the temporary folder of _chapter_file, once made


@pytest.fixture(scope="session")
def model_dir() -> Callable[[str], Path]:
    """`model_dir("tiny-qwen3")` -> the folder, made on first use and cached between runs."""
    return ensure_model


@pytest.fixture
def make_llm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable]:
    """`make_llm(path, **config)` -> an `LLM` (chapter 7 on), 512 pages and float32 unless
    `config` says otherwise (float32 also on a GPU: the tests compare with HF float32); every
    LLM made is shut down after the test. `overlap=True/False` (chapter 11) sets
    MINISGL_DISABLE_OVERLAP_SCHEDULING, which the Scheduler reads when it is made, for this
    test only, and checks that the LLM took it."""
    import torch

    from minisgl.llm import LLM

    made: list = []

    def make(path: Path, overlap: bool | None = None, **config):
        if overlap is not None:
            monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
        config.setdefault("num_page_override", 512)
        config.setdefault("dtype", torch.float32)
        made.append(LLM(str(path), **config))
        if overlap is not None:
            assert made[-1].overlap == overlap
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()
