"""Fixtures that chapter 15's server tests share: tiny-qwen3, and one server on it for each test
module that asks for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from serving import Server


@pytest.fixture(scope="module")
def model(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("tiny-qwen3")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(model, tmp_path_factory.mktemp("server"))
    s.wait_ready()
    yield s
    s.stop()
