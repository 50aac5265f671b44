"""Chapter 22's fixture: `make_driver`, a Driver (driver.py) shut down after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from driver import Driver


@pytest.fixture
def make_driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Driver]]:
    """`make_driver(path, overlap=..., **config)` -> a Driver, float32 unless config says
    otherwise, shut down after the test."""
    made: list[Driver] = []

    def make(path: Path, overlap: bool = True, **config: object) -> Driver:
        monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
        config.setdefault("dtype", torch.float32)
        made.append(Driver(path, **config))
        assert made[-1].overlap == overlap
        return made[-1]

    yield make
    for d in made:
        d.shutdown()
