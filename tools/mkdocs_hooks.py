"""MkDocs hook: expands the `--8<-- "N:path#name"` include lines of the pages (chapter 0)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

_TOOLS = Path(__file__).resolve().parent
_ROOT = _TOOLS.parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))  # tools/ holds the package `book`, shared with tools/steps.py

from book.manifest import Book, StepsError  # noqa: E402
from book.pages import expand_includes  # noqa: E402


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace every include line inside a fenced block by the code it names."""
    if "--8<--" not in markdown:
        return markdown
    try:
        return expand_includes(markdown, Book(_ROOT))
    except StepsError as exc:
        where = getattr(getattr(page, "file", None), "src_uri", "a page")
        raise PluginError(f"{where}: bad include: {exc}") from None
