"""MkDocs hook: expands the `--8<-- "N:path#name"` include lines of the pages via tools/steps.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

_STEPS_PATH = Path(__file__).resolve().parent / "steps.py"
_ROOT = _STEPS_PATH.parent.parent


def _load_steps() -> Any:
    """Import tools/steps.py by path (tools/ is not a package)."""
    name = "minisgl_book_steps"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _STEPS_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look the module up while it executes
        spec.loader.exec_module(module)
    return sys.modules[name]


steps = _load_steps()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace every include line inside a fenced block by the code it names."""
    if "--8<--" not in markdown:
        return markdown
    try:
        return steps.expand_includes(markdown, steps.Book(_ROOT))
    except steps.StepsError as exc:
        where = getattr(getattr(page, "file", None), "src_uri", "a page")
        raise PluginError(f"{where}: bad include: {exc}") from None
