"""Chapter manifests (chapters/chNN_slug/tree.toml) and the Book that holds them (chapter 0).

Chapter N's tree lists the files of "tree N", the code as it stands at the end of chapter N. Each
file's chapter-N content is its frozen copy `chapters/chNN_slug/files/<path>` when one exists,
else its live copy in the repository.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

MARKS = {"new": "[新建]", "modified": "[修改]", "early": "[提前引入]", "same": "[未变]"}


class StepsError(Exception):
    """A problem for the user to fix; printed without a traceback."""


def git_blob_hash(data: bytes) -> str:
    """The hash `git hash-object` gives to `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class TreeFile:
    path: str  # path inside the materialised tree
    status: str  # new | modified | early | same
    hash: str  # git blob sha1 of the chapter-N content
    src: str | None = None  # live location, when not the default one

    def derived_status(self, previous: dict[str, str]) -> str:
        """The status given tree N-1's recorded hashes (path -> hash); early is kept as is."""
        if self.status == "early":
            return "early"
        if self.path not in previous:
            return "new"
        return "same" if previous[self.path] == self.hash else "modified"


@dataclass
class Output:
    id: str
    cmd: list[str]
    where: str = "tree"  # "tree": in the sandboxed tree; "repo": at the repository root
    results: str | None = None  # a benchmark: the committed file its page block shows


@dataclass
class Chapter:
    number: int
    slug: str
    title: str
    page: str
    folder: Path
    files: list[TreeFile]
    outputs: list[Output]

    def file(self, path: str) -> TreeFile | None:
        return next((f for f in self.files if f.path == path), None)

    def output(self, oid: str) -> Output | None:
        return next((o for o in self.outputs if o.id == oid), None)


def read_toml(path: Path, where: str) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise StepsError(f"{where}: cannot read it: {exc}") from exc


def checked_table(data: object, schema: dict[str, type], optional: set[str], where: str) -> dict:
    """`data` checked against `schema` (key -> type): no unknown, missing or mistyped keys."""
    if not isinstance(data, dict):
        raise StepsError(f"{where}: expected a table")
    for key in data.keys() - schema.keys():
        raise StepsError(f"{where}: unknown key {key!r}")
    for key, kind in schema.items():
        if key not in data and key not in optional:
            raise StepsError(f"{where}: missing key {key!r}")
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            raise StepsError(f"{where}: {key!r} must be a {kind.__name__}")
    return data


def check_rel_path(path: str, where: str) -> None:
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise StepsError(f"{where}: {path!r} is not a plain relative path like 'minisgl/x.py'")


TOP_KEYS = {"number": int, "slug": str, "title": str, "page": str, "file": list, "output": list}
FILE_KEYS = {"path": str, "status": str, "hash": str, "src": str}
OUTPUT_KEYS = {"id": str, "cmd": list, "where": str, "results": str}


def load_chapter(folder: Path) -> Chapter:
    where = f"chapters/{folder.name}/tree.toml"
    top = checked_table(read_toml(folder / "tree.toml", where), TOP_KEYS, {"file", "output"}, where)
    number, slug = top["number"], top["slug"]
    if folder.name != f"ch{number:02d}_{slug}":
        raise StepsError(f"{where}: number and slug say ch{number:02d}_{slug}, unlike the folder")
    ch = Chapter(number, slug, top["title"], top["page"], folder, [], [])
    for i, table in enumerate(top.get("file", [])):
        at = f"{where}: [[file]] #{i + 1}"
        f = TreeFile(**checked_table(table, FILE_KEYS, {"src"}, at))
        for path in (f.path, f.src or "x"):
            check_rel_path(path, at)
        if f.status not in MARKS:
            raise StepsError(f"{at}: status must be one of {', '.join(MARKS)}")
        if not re.fullmatch(r"[0-9a-f]{40}", f.hash):
            raise StepsError(f"{at}: hash must be 40 hex digits (run `steps.py rehash {number}`)")
        if ch.file(f.path):
            raise StepsError(f"{at}: {f.path} is listed twice")
        ch.files.append(f)
    for i, table in enumerate(top.get("output", [])):
        at = f"{where}: [[output]] #{i + 1}"
        out = Output(**checked_table(table, OUTPUT_KEYS, {"where", "results"}, at))
        if not out.cmd or not all(isinstance(a, str) for a in out.cmd):
            raise StepsError(f"{at}: cmd must be a non-empty list of strings")
        if out.where not in ("tree", "repo"):
            raise StepsError(f"{at}: where must be 'tree' or 'repo'")
        if not re.fullmatch(r"[\w.-]+", out.id):
            raise StepsError(f"{at}: an output id is made of letters, digits, '_', '.' and '-'")
        if ch.output(out.id):
            raise StepsError(f"{at}: output id {out.id!r} is used twice")
        if out.results is not None:
            check_rel_path(out.results, at)
        ch.outputs.append(out)
    return ch


def toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}
    out = (
        escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c) for c in text
    )
    return '"' + "".join(out) + '"'


def write_manifest(ch: Chapter) -> None:
    """Rewrite `tree.toml` with the keys in the documented order."""
    q = toml_string
    lines = [f"number = {ch.number}", f"slug = {q(ch.slug)}", f"title = {q(ch.title)}"]
    lines.append(f"page = {q(ch.page)}")
    for f in ch.files:
        lines += ["", "[[file]]", f"path = {q(f.path)}", f"status = {q(f.status)}"]
        lines += [f"hash = {q(f.hash)}"] + ([f"src = {q(f.src)}"] if f.src is not None else [])
    for o in ch.outputs:
        cmd = ", ".join(q(a) for a in o.cmd)
        lines += ["", "[[output]]", f"id = {q(o.id)}", f"cmd = [{cmd}]", f"where = {q(o.where)}"]
        lines += [f"results = {q(o.results)}"] if o.results is not None else []
    (ch.folder / "tree.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")


class Book:
    """All chapters of the repository at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        folders = sorted((self.root / "chapters").glob("ch[0-9][0-9]_*"))
        chapters = [load_chapter(p) for p in folders if (p / "tree.toml").is_file()]
        self.chapters = sorted(chapters, key=lambda c: c.number)
        numbers = [c.number for c in self.chapters]
        if len(set(numbers)) != len(numbers):
            raise StepsError("two chapter folders have the same number")

    def get(self, number: int) -> Chapter:
        for ch in self.chapters:
            if ch.number == number:
                return ch
        raise StepsError(f"there is no chapter {number} (see `steps.py list`)")

    def previous(self, ch: Chapter) -> Chapter | None:
        earlier = [c for c in self.chapters if c.number < ch.number]
        return earlier[-1] if earlier else None

    def pages(self) -> list[str]:
        """Every Markdown page under docs/ (chapter pages and the others), repo-relative."""
        return sorted(self.rel(p) for p in (self.root / "docs").rglob("*.md"))

    def chapter_of_page(self, page: str) -> Chapter | None:
        return next((c for c in self.chapters if c.page == page), None)

    def live_path(self, ch: Chapter, f: TreeFile) -> Path:
        if f.src is not None:
            return self.root / f.src
        if f.path.startswith("minisgl/"):
            return self.root / "python" / f.path
        if f.path == "main.py":
            return ch.folder / "main.py"
        return self.root / f.path

    def stored_path(self, ch: Chapter, f: TreeFile) -> Path:
        return ch.folder / "files" / f.path

    def source(self, ch: Chapter, f: TreeFile) -> Path:
        """Where tree N's copy of f is read from: its own frozen copy; for a file the same as in
        tree N-1, wherever tree N-1 reads it from (one frozen copy serves a run of chapters);
        else the live file."""
        stored = self.stored_path(ch, f)
        if stored.is_file():
            return stored
        prev = self.previous(ch)
        if f.status == "same" and prev is not None:
            twin = next((g for g in prev.files if g.path == f.path and g.hash == f.hash), None)
            if twin is not None:
                return self.source(prev, twin)
        return self.live_path(ch, f)

    def rel(self, path: Path) -> str:
        return (
            path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)
        )

    def content(self, ch: Chapter, f: TreeFile) -> bytes:
        path = self.source(ch, f)
        try:
            return path.read_bytes()
        except OSError:
            raise StepsError(
                f"chapter {ch.number}: {f.path} has neither a frozen copy "
                f"{self.rel(self.stored_path(ch, f))} nor a live copy {self.rel(path)}"
            ) from None

    def previous_hashes(self, ch: Chapter) -> dict[str, str]:
        """The hashes recorded by the tree before tree N (path -> hash)."""
        prev = self.previous(ch)
        return {f.path: f.hash for f in prev.files} if prev else {}
