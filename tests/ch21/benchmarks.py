"""Chapter 21's tests: load a script of benchmark/ (no package) from the tree the tests are in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parents[2] / "benchmark"


def load(name: str) -> ModuleType:
    """benchmark/NAME.py as module NAME (registered first: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
