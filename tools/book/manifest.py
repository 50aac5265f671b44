"""Chapter manifests (chapters/chNN_slug/chapter.toml) and the Book that holds them (chapter 0).

Chapter N's tree, "tree N", is the code as it stands at the end of chapter N. Its file list is
the `new` and `gone` lists of chapters 0..N replayed. A path takes its successor's content (the
same path in tree N+1 when tree N+1 holds it, else its live copy: `minisgl/...` is
python/minisgl/..., anything else the same path at the repository root; or, when chapter N's
`delta.patch` renames it, the new path in tree N+1) and applies chapter N's `delta.patch` to it
in reverse (tools/book/delta.py). A top-level path (`main.py`, `skeleton.py`, `naive.py`) is
chapter-owned and has no live copy: tree N reads `chapters/chNN_slug/<path>` when it is there,
else the successor's content through chapter N's delta when the delta has a section for it,
else tree N-1's copy (`record` stores each the shortest way that leaves no cycle).
The newest tree is therefore the live code. Statuses are computed, never stored; `digest`
records what tree N is meant to be (`steps.py record`).
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from book import delta
from book.delta import DeltaError, FileDelta

MARKS = {"new": "[新建]", "modified": "[修改]", "early": "[提前引入]", "same": "[未变]"}


class StepsError(Exception):
    """A problem for the user to fix; printed without a traceback."""


def git_blob_hash(data: bytes) -> str:
    """The hash `git hash-object` gives to `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_digest(tree: dict[str, bytes]) -> str:
    """A tree's digest: sha1 over its sorted `blobhash path` lines."""
    body = "".join(f"{git_blob_hash(data)} {path}\n" for path, data in sorted(tree.items()))
    return hashlib.sha1(body.encode("utf-8")).hexdigest()


def owned(path: str) -> bool:
    """A chapter-owned path (main.py, skeleton.py, naive.py): it has no live copy."""
    return "/" not in path


def live_rel(path: str) -> str:
    """Where a tree path's live copy sits, relative to the repository root."""
    return "python/" + path if path.startswith("minisgl/") else path


@dataclass
class TreeFile:
    path: str  # path inside the materialised tree


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
    digest: str | None = None  # of tree N, as recorded by `steps.py record`
    new: list[str] = field(default_factory=list)  # paths tree N adds to tree N-1
    gone: list[str] = field(default_factory=list)  # paths tree N drops from tree N-1
    early: list[str] = field(default_factory=list)  # paths shown as [提前引入]

    def file(self, path: str) -> TreeFile | None:
        return next((f for f in self.files if f.path == path), None)

    def output(self, oid: str) -> Output | None:
        return next((o for o in self.outputs if o.id == oid), None)

    @property
    def patch(self) -> Path:
        return self.folder / "delta.patch"


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


def toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}
    out = (
        escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c) for c in text
    )
    return '"' + "".join(out) + '"'


TOP_KEYS = {
    "title": str,
    "page": str,
    "digest": str,
    "new": list,
    "gone": list,
    "early": list,
    "output": list,
}
OUTPUT_KEYS = {"id": str, "cmd": list, "where": str, "results": str}
FOLDER_RE = re.compile(r"ch([0-9]{2})_([\w-]+)")


def path_list(top: dict, key: str, where: str) -> list[str]:
    paths = top.get(key, [])
    if not all(isinstance(p, str) for p in paths):
        raise StepsError(f"{where}: {key!r} must be a list of paths")
    for p in paths:
        check_rel_path(p, f"{where}: {key}")
    if len(set(paths)) != len(paths):
        raise StepsError(f"{where}: {key!r} lists a path twice")
    return paths


def load_chapter(folder: Path) -> Chapter:
    where = f"chapters/{folder.name}/chapter.toml"
    m = FOLDER_RE.fullmatch(folder.name)
    if m is None:
        raise StepsError(f"{where}: the folder name is not chNN_slug")
    opt = {"digest", "new", "gone", "early", "output"}
    top = checked_table(read_toml(folder / "chapter.toml", where), TOP_KEYS, opt, where)
    if "digest" in top and not re.fullmatch(r"[0-9a-f]{40}", top["digest"]):
        raise StepsError(f"{where}: digest must be 40 hex digits (run `steps.py record`)")
    ch = Chapter(int(m[1]), m[2], top["title"], top["page"], folder, [], [], top.get("digest"))
    ch.new, ch.gone, ch.early = (path_list(top, k, where) for k in ("new", "gone", "early"))
    for i, table in enumerate(top.get("output", [])):
        at = f"{where}: output #{i + 1}"
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


def write_digest(ch: Chapter, digest: str) -> None:
    """Set `digest` in chapter.toml, leaving every other line as it is."""
    path = ch.folder / "chapter.toml"
    lines = path.read_text(encoding="utf-8").split("\n")
    line = f"digest = {toml_string(digest)}  # of tree {ch.number}; written by steps.py"
    at = next((i for i, x in enumerate(lines) if x.startswith("digest =")), None)
    if at is None:
        at = next((i + 1 for i, x in enumerate(lines) if x.startswith("page =")), 0)
        lines.insert(at, line)
    else:
        lines[at] = line
    path.write_text("\n".join(lines), encoding="utf-8")
    ch.digest = digest


class Book:
    """All chapters of the repository at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        folders = sorted((self.root / "chapters").glob("ch[0-9][0-9]_*"))
        chapters = [load_chapter(p) for p in folders if (p / "chapter.toml").is_file()]
        self.chapters = sorted(chapters, key=lambda c: c.number)
        numbers = [c.number for c in self.chapters]
        if len(set(numbers)) != len(numbers):
            raise StepsError("two chapter folders have the same number")
        self.paths: dict[int, set[str]] = {}
        prev: set[str] = set()
        for ch in self.chapters:
            where = f"chapters/{ch.folder.name}/chapter.toml"
            for p in ch.gone:
                if p not in prev:
                    raise StepsError(f"{where}: gone names {p}, which tree N-1 does not hold")
            for p in ch.new:
                if p in prev and p not in ch.gone:
                    raise StepsError(f"{where}: new names {p}, which tree N-1 holds already")
            paths = (prev - set(ch.gone)) | set(ch.new)
            for p in ch.early:
                if p not in paths:
                    raise StepsError(f"{where}: early names {p}, which tree {ch.number} lacks")
            ch.files = [TreeFile(p) for p in sorted(paths)]
            self.paths[ch.number] = paths
            prev = paths
        self._deltas: dict[int, dict[str, FileDelta]] = {}
        self._cache: dict[tuple[int, str], bytes] = {}
        self._local = threading.local()  # what this thread is resolving (`check --jobs`)

    def get(self, number: int) -> Chapter:
        for ch in self.chapters:
            if ch.number == number:
                return ch
        raise StepsError(f"there is no chapter {number} (see `steps.py list`)")

    def previous(self, ch: Chapter) -> Chapter | None:
        earlier = [c for c in self.chapters if c.number < ch.number]
        return earlier[-1] if earlier else None

    def following(self, ch: Chapter) -> Chapter | None:
        later = [c for c in self.chapters if c.number > ch.number]
        return later[0] if later else None

    def pages(self) -> list[str]:
        """Every Markdown page under docs/ (chapter pages and the others), repo-relative."""
        return sorted(self.rel(p) for p in (self.root / "docs").rglob("*.md"))

    def chapter_of_page(self, page: str) -> Chapter | None:
        return next((c for c in self.chapters if c.page == page), None)

    def rel(self, path: Path) -> str:
        return (
            path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)
        )

    def delta(self, ch: Chapter) -> dict[str, FileDelta]:
        """Chapter N's delta.patch, parsed (empty when there is none); read as bytes."""
        if ch.number not in self._deltas:
            name = self.rel(ch.patch)
            try:
                self._deltas[ch.number] = (
                    delta.read_patch(ch.patch, name) if ch.patch.is_file() else {}
                )
            except DeltaError as exc:
                raise StepsError(str(exc)) from None
        return self._deltas[ch.number]

    def successor(
        self, ch: Chapter, path: str, section: FileDelta | None = None
    ) -> tuple[bytes, str]:
        """(content, `+++` label) of the successor of tree N's `path`; `section` is chapter N's
        section for it, whose rename (if any) names the successor's path in tree N+1."""
        nxt = self.following(ch)
        if section is not None and section.rename is not None:
            self.check_rename(ch, nxt, section)
            assert nxt is not None
            new = section.rename
            return self.content_at(nxt, new), delta.tree_label(nxt.number, new)
        if nxt is not None and path in self.paths[nxt.number]:
            return self.content_at(nxt, path), delta.tree_label(nxt.number, path)
        live = self.root / live_rel(path)
        if not owned(path) and live.is_file():
            return live.read_bytes(), f"repo/{live_rel(path)}"
        return b"", delta.DEV_NULL

    def check_rename(self, ch: Chapter, nxt: Chapter | None, section: FileDelta) -> None:
        """Fail unless chapter N's rename of `section.path` fits the trees: the old path is in
        tree N and not tree N+1, the new one in tree N+1 and not tree N, neither chapter-owned."""
        old, new = section.path, section.rename
        assert new is not None
        where = f"{self.rel(ch.patch)}: {old}: renamed to {new}, but"
        stale = f"the trees changed without the delta being re-derived ({delta.RECORD_HINT})"
        if nxt is None:
            raise StepsError(f"{where} tree {ch.number} is the newest; {stale}")
        if owned(new):
            raise StepsError(f"{where} {new} is chapter-owned (stored whole)")
        if old in self.paths[nxt.number]:
            raise StepsError(f"{where} tree {nxt.number} still holds {old}; {stale}")
        if new not in self.paths[nxt.number]:
            raise StepsError(f"{where} tree {nxt.number} has no {new}; {stale}")
        if new in self.paths[ch.number]:
            raise StepsError(f"{where} tree {ch.number} holds {new} too; {stale}")

    def content_at(self, ch: Chapter, path: str) -> bytes:
        """Tree N's content of `path` (memoised); StepsError when it cannot be made."""
        key = (ch.number, path)
        if key in self._cache:
            return self._cache[key]
        if path not in self.paths[ch.number]:
            raise StepsError(f"tree {ch.number} has no {path}")
        resolving: set[tuple[int, str]] = self._local.__dict__.setdefault("resolving", set())
        if key in resolving:
            raise StepsError(
                f"chapter {ch.number}: {path} is derived from itself (a delta against a later "
                f"tree's copy, which inherits it back): {delta.RECORD_HINT}"
            )
        resolving.add(key)
        try:
            data = self._resolve(ch, path)
        finally:
            resolving.discard(key)
        self._cache[key] = data
        return data

    def _resolve(self, ch: Chapter, path: str) -> bytes:
        section = self.delta(ch).get(path)
        if owned(path):
            own = ch.folder / path
            prev = self.previous(ch)
            if own.is_file():
                return own.read_bytes()
            if section is None:
                if prev is not None and path in self.paths[prev.number]:
                    return self.content_at(prev, path)
                raise StepsError(
                    f"chapter {ch.number}: {path} has no copy {self.rel(own)}, no section in "
                    f"{self.rel(ch.patch)}, and tree "
                    f"{ch.number - 1 if prev is None else prev.number} has none to inherit"
                )
        succ, label = self.successor(ch, path, section)
        name = self.rel(ch.patch)
        if section is None:
            if label == delta.DEV_NULL:
                raise StepsError(
                    f"chapter {ch.number}: {path} has no live copy {live_rel(path)}, no "
                    f"later tree holds it, and {name} has no section for it"
                )
            return succ
        try:
            delta.check_successor(section, label, name)
            text = delta.decode_text(succ, label)
            return delta.apply_reverse(
                text, section.hunks, patch=name, path=path, successor=label
            ).encode("utf-8")
        except DeltaError as exc:
            raise StepsError(str(exc)) from None

    def content(self, ch: Chapter, f: TreeFile) -> bytes:
        return self.content_at(ch, f.path)

    def tree(self, ch: Chapter) -> dict[str, bytes]:
        """Every file of tree N (path -> content)."""
        return {f.path: self.content_at(ch, f.path) for f in ch.files}

    def digest(self, ch: Chapter) -> str:
        return tree_digest(self.tree(ch))

    def statuses(self, ch: Chapter) -> dict[str, str]:
        """path -> new | modified | same | early, computed against tree N-1."""
        prev = self.previous(ch)
        before = self.paths[prev.number] if prev is not None else set()
        out = {}
        for f in ch.files:
            if f.path in ch.early:
                out[f.path] = "early"
            elif f.path not in before:
                out[f.path] = "new"
            else:
                same = self.content_at(ch, f.path) == self.content_at(prev, f.path)
                out[f.path] = "same" if same else "modified"
        return out

    def delta_problems(self, ch: Chapter) -> list[str]:
        """Sections of chapter N's delta that name no path of tree N, or a chapter-owned path
        that chapter N's folder also stores whole."""
        try:
            sections = self.delta(ch)
        except StepsError as exc:
            return [str(exc)]
        name = self.rel(ch.patch)
        problems = [
            f"{name}: a section for {p}, which tree {ch.number} lacks"
            for p in sections
            if p not in self.paths[ch.number]
        ]
        problems += [
            f"{name}: a section for {p}, which is also stored whole in "
            f"chapters/{ch.folder.name}/{p}: {delta.RECORD_HINT} {ch.number} to keep one"
            for p in sections
            if owned(p) and (ch.folder / p).is_file()
        ]
        return problems
