"""Per-chapter build and check tool for the book (introduced with chapter 0).

Chapter N lives in `chapters/chNN_slug/`; its `tree.toml` lists the files of "tree N", the
code as it stands at the end of chapter N. Each file's chapter-N content is its frozen copy
`chapters/chNN_slug/files/<path>` when one exists, else its live copy in the repository.

Commands (all take `--root DIR` first to work on another repository):

    list                      one line per chapter
    tree N                    the file tree block for the top of chapter N's page
    build N DIR               write tree N into DIR (empty or absent)
    diff N                    unified diff from tree N-1 to tree N
    run N [-- ARGS]           run chapter N's main in isolation
    check [N ...] [--no-run]  enforce the eight properties (every chapter when none given)
    pages [N ...] [--force]   regenerate the tree and output blocks of the pages
    rehash N                  record tree N's current hashes (chapter N was meant to change)
    freeze                    store the old copy of each file whose live copy a later chapter edited

When chapter N edits a file that earlier chapters hold too: edit the live copy, then run
`rehash N`, `freeze`, `pages N` and `check`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import tomllib

MARKS = {"new": "[新建]", "modified": "[修改]", "early": "[提前引入]", "same": "[未变]"}
TREE_BEGIN, TREE_END = "<!-- tree: begin -->", "<!-- tree: end -->"
ILLUSTRATION = "<!-- illustration -->"
MASK_LINE = "# mask-line"
OUTPUT_RE = re.compile(r"^\s*<!--\s*output:\s*(\S+?)\s*-->\s*$")
INCLUDE_RE = re.compile(r'^(\s*)--8<--\s+"([^"]*)"\s*$')
INCLUDE_SPEC_RE = re.compile(r"(repo|\d+):([^#]+?)(?:#([\w.]+)|:(\d+):(\d+))?")
FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
UNITS = "tokens/s|tok/s|it/s|毫秒|秒|sec|min|ms|µs|μs|us|s|KiB|MiB|GiB|KB|MB|GB|B|x|倍"
NUMBER_RE = r"(?<![A-Za-z0-9_.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
QUANTITY_RE = re.compile(rf"{NUMBER_RE}[ \t]*({UNITS})(?![A-Za-z0-9_/])")
DATE_RE = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
    r"|(?<!\d)\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
)
DEFAULT_TIMEOUT = 1800.0
PROPERTIES = {
    1: "tree materialises",
    2: "main runs",
    3: "tests pass",
    4: "python/minisgl = tree",
    5: "page matches tree",
    6: "outputs match",
    7: "every file used",
    8: "hashes recorded",
}


class StepsError(Exception):
    """A problem for the user to fix; printed without a traceback."""


def git_blob_hash(data: bytes) -> str:
    """The hash `git hash-object` gives to `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ---------------------------------------------------------------------------- manifests


@dataclass
class TreeFile:
    path: str  # path inside the materialised tree
    status: str  # new | modified | early | same
    hash: str  # git blob sha1 of the chapter-N content
    src: str | None = None  # live location, when not the default one


@dataclass
class Output:
    id: str
    cmd: list[str]
    where: str = "tree"  # "tree" or "repo"


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


TOP_KEYS = {"number": int, "slug": str, "title": str, "page": str, "file": list, "output": list}
FILE_KEYS = {"path": str, "status": str, "hash": str, "src": str}
OUTPUT_KEYS = {"id": str, "cmd": list, "where": str}
OPTIONAL_KEYS = {"file", "output", "src", "where"}


def _table(data: object, schema: dict[str, type], where: str) -> dict:
    """`data` checked against `schema` (key -> type): no unknown, missing or mistyped keys."""
    if not isinstance(data, dict):
        raise StepsError(f"{where}: expected a table")
    for key in data.keys() - schema.keys():
        raise StepsError(f"{where}: unknown key {key!r}")
    for key, kind in schema.items():
        if key not in data and key not in OPTIONAL_KEYS:
            raise StepsError(f"{where}: missing key {key!r}")
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            raise StepsError(f"{where}: {key!r} must be a {kind.__name__}")
    return data


def _check_rel_path(path: str, where: str) -> None:
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise StepsError(f"{where}: {path!r} is not a plain relative path like 'minisgl/x.py'")


def load_chapter(folder: Path) -> Chapter:
    where = f"chapters/{folder.name}/tree.toml"
    try:
        data = tomllib.loads((folder / "tree.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise StepsError(f"{where}: cannot read the manifest: {exc}") from exc
    top = _table(data, TOP_KEYS, where)
    number, slug = top["number"], top["slug"]
    if folder.name != f"ch{number:02d}_{slug}":
        raise StepsError(f"{where}: number and slug say ch{number:02d}_{slug}, unlike the folder")
    ch = Chapter(number, slug, top["title"], top["page"], folder, [], [])
    for i, table in enumerate(top.get("file", [])):
        at = f"{where}: [[file]] #{i + 1}"
        f = TreeFile(**_table(table, FILE_KEYS, at))
        for path in (f.path, f.src or "x"):
            _check_rel_path(path, at)
        if f.status not in MARKS:
            raise StepsError(f"{at}: status must be one of {', '.join(MARKS)}")
        if not re.fullmatch(r"[0-9a-f]{40}", f.hash):
            raise StepsError(f"{at}: hash must be 40 hex digits (run `steps.py rehash {number}`)")
        if ch.file(f.path):
            raise StepsError(f"{at}: {f.path} is listed twice")
        ch.files.append(f)
    for i, table in enumerate(top.get("output", [])):
        at = f"{where}: [[output]] #{i + 1}"
        out = Output(**_table(table, OUTPUT_KEYS, at))
        if not out.cmd or not all(isinstance(a, str) for a in out.cmd):
            raise StepsError(f"{at}: cmd must be a non-empty list of strings")
        if out.where not in ("tree", "repo"):
            raise StepsError(f"{at}: where must be 'tree' or 'repo'")
        if any(o.id == out.id for o in ch.outputs):
            raise StepsError(f"{at}: output id {out.id!r} is used twice")
        ch.outputs.append(out)
    return ch


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}
    out = (
        escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c) for c in text
    )
    return '"' + "".join(out) + '"'


def write_manifest(ch: Chapter) -> None:
    """Rewrite `tree.toml` with the keys in the documented order."""
    q = _toml_string
    lines = [f"number = {ch.number}", f"slug = {q(ch.slug)}", f"title = {q(ch.title)}"]
    lines.append(f"page = {q(ch.page)}")
    for f in ch.files:
        lines += ["", "[[file]]", f"path = {q(f.path)}", f"status = {q(f.status)}"]
        lines.append(f"hash = {q(f.hash)}")
        if f.src is not None:
            lines.append(f"src = {q(f.src)}")
    for o in ch.outputs:
        cmd = ", ".join(q(a) for a in o.cmd)
        lines += ["", "[[output]]", f"id = {q(o.id)}", f"cmd = [{cmd}]", f"where = {q(o.where)}"]
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
        stored = self.stored_path(ch, f)
        return stored if stored.is_file() else self.live_path(ch, f)

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

    def materialise(self, ch: Chapter, dest: Path) -> None:
        for f in ch.files:
            target = dest / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.content(ch, f))


def derived_status(f: TreeFile, previous: dict[str, str]) -> str:
    """The status `f` should have given tree N-1's recorded hashes (early is kept as is)."""
    if f.status == "early":
        return "early"
    if f.path not in previous:
        return "new"
    return "same" if previous[f.path] == f.hash else "modified"


def previous_hashes(book: Book, ch: Chapter) -> dict[str, str]:
    prev = book.previous(ch)
    return {f.path: f.hash for f in prev.files} if prev else {}


# ---------------------------------------------------------------------------- tree, diff


def render_tree(marks: dict[str, str]) -> str:
    """A box-drawing tree of `marks` (path -> mark), directories first, marks aligned."""
    root: dict = {}
    for path in marks:
        node = root
        *dirs, leaf = path.split("/")
        for d in dirs:
            node = node.setdefault(d + "/", {})
        node[leaf] = path
    rows: list[tuple[str, str]] = [(".", "")]

    def walk(node: dict, prefix: str) -> None:
        names = sorted(node, key=lambda n: (not n.endswith("/"), n))
        for i, name in enumerate(names):
            last = i == len(names) - 1
            label = prefix + ("└── " if last else "├── ") + name
            if isinstance(node[name], dict):
                rows.append((label, ""))
                walk(node[name], prefix + ("    " if last else "│   "))
            else:
                rows.append((label, marks[node[name]]))

    walk(root, "")
    width = max((len(label) for label, mark in rows if mark), default=0) + 2
    return "\n".join(f"{label:<{width}}{mark}".rstrip() for label, mark in rows)


def tree_text(ch: Chapter) -> str:
    return render_tree({f.path: MARKS[f.status] for f in ch.files})


def diff_text(book: Book, ch: Chapter) -> str:
    prev = book.previous(ch)
    old = {f.path: book.content(prev, f) for f in prev.files} if prev else {}
    new = {f.path: book.content(ch, f) for f in ch.files}
    out: list[str] = []
    for path in sorted(old.keys() | new.keys()):
        if old.get(path) == new.get(path):
            continue
        a = old[path].decode("utf-8", "replace").splitlines(True) if path in old else []
        b = new[path].decode("utf-8", "replace").splitlines(True) if path in new else []
        names = (
            f"a/{path}" if path in old else "/dev/null",
            f"b/{path}" if path in new else "/dev/null",
        )
        for line in difflib.unified_diff(a, b, *names):
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


# ---------------------------------------------------------------------------- includes


def extract_symbol(source: str, symbol: str, label: str) -> str:
    """The source of top-level def/class `symbol` (or `Class.method`), decorators included."""
    try:
        body = ast.parse(source).body
    except SyntaxError as exc:
        raise StepsError(f"{label}: cannot parse: {exc}") from None
    node: ast.AST | None = None
    for part in symbol.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            raise StepsError(f"{label}: has no def or class {symbol!r}")
        body = node.body if isinstance(node, ast.ClassDef) else []
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return textwrap.dedent("\n".join(source.splitlines()[start - 1 : node.end_lineno]))


def resolve_include(book: Book, spec: str, page_chapter: int | None = None) -> str:
    """The text an include line stands for (no trailing newline); StepsError when it is bad."""
    m = INCLUDE_SPEC_RE.fullmatch(spec)
    if m is None:
        raise StepsError(
            f'bad include "{spec}": expected "N:path", "N:path#name", '
            '"N:path:START:END" or "repo:path" (same suffixes)'
        )
    scope, rel, symbol = m[1], m[2], m[3]
    if scope == "repo":
        if (rel + "/").startswith(("python/minisgl/", "tests/")):
            raise StepsError(f'"{spec}": include minisgl and test files from a tree ("N:path")')
        path = (book.root / rel).resolve()
        if not path.is_relative_to(book.root) or not path.is_file():
            raise StepsError(f'"{spec}": {rel} is not a file of the repository')
        data, label = path.read_bytes(), rel
    else:
        number = int(scope)
        if page_chapter is not None and number != page_chapter:
            raise StepsError(
                f'"{spec}": a page of chapter {page_chapter} includes from tree {page_chapter}'
            )
        ch = book.get(number)
        f = ch.file(rel)
        if f is None:
            raise StepsError(f'"{spec}": tree {number} has no {rel} (see `steps.py tree {number}`)')
        data, label = book.content(ch, f), f"tree {number}: {rel}"
    text = data.decode("utf-8", "replace")
    if symbol is not None:
        return extract_symbol(text, symbol, label)
    if m[4] is not None:
        start, end = int(m[4]), int(m[5])
        lines = text.splitlines()
        if not 1 <= start <= end <= len(lines):
            raise StepsError(f'"{spec}": {label} has {len(lines)} lines, not {start}..{end}')
        return textwrap.dedent("\n".join(lines[start - 1 : end]))
    return text.rstrip("\n")


@dataclass
class Fence:
    start: int  # index of the opening line
    end: int  # index of the closing line (len(lines) when never closed)
    info: str

    @property
    def is_python(self) -> bool:
        return self.info.lstrip("{. ").startswith(("python", "py"))


def find_fences(lines: list[str]) -> list[Fence]:
    fences: list[Fence] = []
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m or (m[2][0] == "`" and "`" in m[3]):
            i += 1
            continue
        j = i + 1
        while j < len(lines):
            c = FENCE_RE.match(lines[j])
            if c and c[2][0] == m[2][0] and len(c[2]) >= len(m[2]) and not c[3].strip():
                break
            j += 1
        fences.append(Fence(i, j, m[3].strip()))
        i = j + 1
    return fences


def expand_includes(markdown: str, book: Book, page_chapter: int | None = None) -> str:
    """Replace every include line inside a fenced block by the text it names."""
    lines = markdown.split("\n")
    out: list[str] = []
    inside = {i for f in find_fences(lines) for i in range(f.start + 1, f.end)}
    for i, line in enumerate(lines):
        m = INCLUDE_RE.match(line) if i in inside else None
        if m is None:
            out.append(line)
            continue
        try:
            text = resolve_include(book, m[2], page_chapter)
        except StepsError as exc:
            raise StepsError(f"line {i + 1}: {exc}") from None
        out += [m[1] + t if t.strip() else "" for t in text.split("\n")]
    return "\n".join(out)


# ---------------------------------------------------------------------------- pages


def previous_nonblank(lines: list[str], index: int) -> str:
    for line in reversed(lines[:index]):
        if line.strip():
            return line.strip()
    return ""


def find_tree_block(lines: list[str], fences: list[Fence]) -> tuple[int, int, Fence | None]:
    """(begin marker, end marker, text fence between them or None); StepsError when absent."""
    begins = [i for i, line in enumerate(lines) if line.strip() == TREE_BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == TREE_END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise StepsError(
            f"needs exactly one {TREE_BEGIN} ... {TREE_END} pair around a ```text block"
        )
    inner = [f for f in fences if begins[0] < f.start and f.end < ends[0]]
    fence = inner[0] if len(inner) == 1 and inner[0].info == "text" else None
    return begins[0], ends[0], fence


def find_output_blocks(
    lines: list[str], fences: list[Fence]
) -> list[tuple[str, int, Fence | None]]:
    """(id, marker line, following ```text fence or None) for every output marker."""
    inside = {i for f in fences for i in range(f.start, f.end + 1)}
    starts = {f.start: f for f in fences}
    blocks = []
    for i, line in enumerate(lines):
        m = OUTPUT_RE.match(line)
        if m is None or i in inside:
            continue
        j = next((k for k in range(i + 1, len(lines)) if lines[k].strip()), len(lines))
        fence = starts.get(j)
        blocks.append((m[1], i, fence if fence is not None and fence.info == "text" else None))
    return blocks


def read_page(book: Book, ch: Chapter) -> list[str]:
    page = book.root / ch.page
    if not page.is_file():
        raise StepsError(f"{ch.page} does not exist (manifest key `page`)")
    return page.read_text(encoding="utf-8").split("\n")


def check_page(book: Book, ch: Chapter) -> list[str]:
    """Property 5: tree block, python blocks, includes."""
    try:
        lines = read_page(book, ch)
    except StepsError as exc:
        return [str(exc)]
    fences = find_fences(lines)
    problems = []
    try:
        _, _, fence = find_tree_block(lines, fences)
        body = [] if fence is None else [x.rstrip() for x in lines[fence.start + 1 : fence.end]]
        if body != tree_text(ch).split("\n"):
            diff = difflib.unified_diff(
                body, tree_text(ch).split("\n"), "page", "manifest", lineterm=""
            )
            problems.append(
                f"{ch.page}: the tree block differs from `steps.py tree {ch.number}`; "
                f"run `steps.py pages {ch.number}`\n" + "\n".join(list(diff)[2:22])
            )
    except StepsError as exc:
        problems.append(f"{ch.page}: {exc}")
    for fence in fences:
        where = f"{ch.page}:{fence.start + 1}"
        if fence.end == len(lines):
            problems.append(f"{where}: this fenced block is never closed")
        body = lines[fence.start + 1 : fence.end]
        if fence.is_python:
            code = [x for x in body if x.strip()]
            if (not code or not all(INCLUDE_RE.match(x) for x in code)) and previous_nonblank(
                lines, fence.start
            ) != ILLUSTRATION:
                problems.append(
                    f"{where}: python block pasted, not included: use only "
                    f'`--8<-- "{ch.number}:path#name"` lines, or put {ILLUSTRATION} above it'
                )
        for k, line in enumerate(body):
            if m := INCLUDE_RE.match(line):
                try:
                    resolve_include(book, m[2], ch.number)
                except StepsError as exc:
                    problems.append(f"{ch.page}:{fence.start + k + 2}: {exc}")
    return problems


def check_output_ids(ch: Chapter, lines: list[str]) -> list[str]:
    """The static half of property 6: markers and [[output]] ids agree."""
    blocks = find_output_blocks(lines, find_fences(lines))
    known = {o.id for o in ch.outputs}
    problems = [
        f"{ch.page}:{i + 1}: unknown output id {oid!r}" for oid, i, _ in blocks if oid not in known
    ]
    problems += [
        f"{ch.page}:{i + 1}: <!-- output: {oid} --> must be followed by a ```text block "
        f"(run `steps.py pages {ch.number}`)"
        for oid, i, fence in blocks
        if fence is None
    ]
    used = {oid for oid, _, _ in blocks}
    problems += [
        f"{ch.page}: [[output]] {o.id!r} is not used (add <!-- output: {o.id} -->)"
        for o in ch.outputs
        if o.id not in used
    ]
    return problems


def mask(text: str) -> str:
    """Hide what changes from run to run: dates, times, durations, rates and sizes."""
    text = DATE_RE.sub("<date>", text)
    return QUANTITY_RE.sub(lambda m: f"<N {m[1]}>", text)


def normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _before_digit(line: str) -> str:
    return re.split(r"\d", line, maxsplit=1)[0]


def outputs_match(expected: str, actual: str) -> bool:
    exp, act = normalise(mask(expected)), normalise(mask(actual))
    return len(exp) == len(act) and all(
        a == b or ((MASK_LINE in a or MASK_LINE in b) and _before_digit(a) == _before_digit(b))
        for a, b in zip(exp, act)
    )


# ---------------------------------------------------------------------------- isolated runs

SITECUSTOMIZE = '''\
"""Written by tools/steps.py: keep the tree's modules inside the tree; log what gets imported."""
import atexit
import importlib.machinery
import os
import sys

TREE = {tree!r}
GUARDED = {guarded!r}


class TreeOnlyFinder:
    """Finds the tree's top-level modules (and their submodules) only inside the tree."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in GUARDED:
            return None
        where = [TREE] if path is None else [
            p for p in path if os.path.realpath(p).startswith(TREE + os.sep)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, where)
        if spec is None:
            raise ModuleNotFoundError(
                f"{{fullname}} is not in this chapter's tree ({{TREE}}): add the file to the "
                "chapter's tree.toml, or do without it", name=fullname)
        return spec


_OPENED = set()  # set() rather than a literal: this text goes through str.format


def _audit(event, args):
    """Every file this process opens (imports included), recorded as it happens: pytest may
    drop a module from sys.modules (two conftest.py files do that), so exit is too late."""
    if event == "open" and args and isinstance(args[0], str):
        real = os.path.realpath(args[0])
        if real.startswith(TREE + os.sep):
            _OPENED.add(real[len(TREE) + 1:])


def _log_imports():
    log = os.environ.get("MINISGL_STEPS_LOG")
    if not log:
        return
    used = set(name for name in _OPENED if not name.startswith(".steps/"))
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        real = os.path.realpath(file) if isinstance(file, str) else ""
        if real.startswith(TREE + os.sep) and not real.startswith(TREE + "/.steps/"):
            used.add(real[len(TREE) + 1:])
    with open(log, "a", encoding="utf-8") as stream:
        stream.write("".join(name + "\\n" for name in sorted(used)))


sys.meta_path.insert(0, TreeOnlyFinder)
sys.addaudithook(_audit)
atexit.register(_log_imports)
'''


@dataclass
class RunResult:
    returncode: int | None  # None when the command timed out
    stdout: str
    stderr: str

    def failure(self, what: str, timeout: float) -> str | None:
        """None when the run succeeded, else a message with the end of its output."""
        if self.returncode == 0:
            return None
        head = (
            f"{what} timed out after {timeout:g} s"
            if self.returncode is None
            else (f"{what} exited with {self.returncode}")
        )
        tail = "\n".join((self.stdout + "\n" + self.stderr).strip().split("\n")[-25:])
        return f"{head}:\n{tail}"


def prepare_sandbox(book: Book, ch: Chapter, dest: Path) -> None:
    """Materialise tree N into `dest` and add the isolation machinery."""
    book.materialise(ch, dest)
    if (book.root / "models").exists() and not (dest / "models").exists():
        (dest / "models").symlink_to(book.root / "models")
    guarded = {"minisgl"} | {f.path.split("/")[0].removesuffix(".py") for f in ch.files}
    (dest / ".steps").mkdir()
    text = SITECUSTOMIZE.format(tree=os.path.realpath(dest), guarded=sorted(guarded))
    (dest / ".steps" / "sitecustomize.py").write_text(text, encoding="utf-8")


def run_command(
    book: Book,
    cmd: list[str],
    cwd: Path,
    sandbox: bool,
    timeout: float,
    log: str = "imports.log",
    capture: bool = True,
) -> RunResult:
    """Run `cmd` (argv[0] "python" = this interpreter) in a sandbox or at the repo root."""
    env = dict(os.environ, MINISGL_REPO=str(book.root), PYTHONDONTWRITEBYTECODE="1")
    if sandbox:
        env["PYTHONPATH"] = f"{cwd / '.steps'}{os.pathsep}{cwd}"
        env["MINISGL_STEPS_LOG"] = str(cwd / ".steps" / log)
    else:
        env["PYTHONPATH"] = str(book.root / "python")
        env.pop("MINISGL_STEPS_LOG", None)
    argv = [sys.executable if i == 0 and a == "python" else a for i, a in enumerate(cmd)]
    pipe = subprocess.PIPE if capture else None
    # A captured command gets its own process group, so that whatever it starts (servers,
    # workers) is killed with it; an interactive one (`run N`) stays in the terminal's group.
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=capture
    )
    returncode: int | None = None
    try:
        out, err = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        if capture:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        out, err = proc.communicate()
    finally:
        if capture:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return RunResult(returncode, out or "", err or "")


def run_outputs(
    book: Book, ch: Chapter, box: Path, timeout: float, cache: dict[tuple, RunResult]
) -> dict[str, RunResult]:
    results = {}
    for out in ch.outputs:
        key = (out.where, tuple(out.cmd))
        if key not in cache:
            cwd = box if out.where == "tree" else book.root
            cache[key] = run_command(
                book, out.cmd, cwd, out.where == "tree", timeout, "outputs.log"
            )
        results[out.id] = cache[key]
    return results


# ---------------------------------------------------------------------------- check


def check_python_tree(book: Book) -> list[str]:
    """Property 4: the newest tree's minisgl/ equals python/minisgl/ byte for byte."""
    ch = book.chapters[-1]
    tree = {f.path.removeprefix("minisgl/"): f for f in ch.files if f.path.startswith("minisgl/")}
    base = book.root / "python" / "minisgl"
    live = (
        {
            p.relative_to(base).as_posix()
            for p in base.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        }
        if base.is_dir()
        else set()
    )
    if not tree:
        extra = sorted(live - {"__init__.py"})
        return [f"python/minisgl/{p} exists but tree {ch.number} has no minisgl/" for p in extra]
    problems = [
        f"python/minisgl/{p} is not in tree {ch.number} (newest); add it to "
        f"chapters/{ch.folder.name}/tree.toml or delete it"
        for p in sorted(live - tree.keys())
    ]
    problems += [
        f"tree {ch.number} (newest) holds minisgl/{p} but python/minisgl/{p} is missing"
        for p in sorted(tree.keys() - live)
    ]
    for p in sorted(tree.keys() & live):
        if book.content(ch, tree[p]) != (base / p).read_bytes():
            problems.append(
                f"minisgl/{p}: tree {ch.number} (newest) content differs from "
                f"python/minisgl/{p}: drop its frozen copy or its src override"
            )
    return problems


def check_hashes(book: Book, ch: Chapter) -> list[str]:
    """Property 8: recorded hashes equal the chapter-N content; status rules hold."""
    prev, problems = previous_hashes(book, ch), []
    for f in ch.files:
        try:
            actual = git_blob_hash(book.content(ch, f))
        except StepsError:
            continue  # reported by property 1
        if actual != f.hash:
            problems.append(
                f"{f.path}: its chapter-{ch.number} content ({book.rel(book.source(ch, f))}) "
                f"changed but tree.toml still records the old hash: run `steps.py freeze` if a "
                f"later chapter edited the live copy, or `steps.py rehash {ch.number}` if chapter "
                f"{ch.number} itself was meant to change"
            )
        if f.status == "early" and not book.stored_path(ch, f).is_file():
            problems.append(
                f"{f.path}: status early needs a stored copy {book.rel(book.stored_path(ch, f))}"
            )
        elif f.status != derived_status(f, prev):
            problems.append(
                f"{f.path}: status {f.status} but it should be {derived_status(f, prev)} "
                f"(compared with the previous tree); run `steps.py rehash {ch.number}`"
            )
    return problems


def check_used(book: Book, ch: Chapter, box: Path) -> list[str]:
    """Property 7: every file was imported or opened; a non-.py file may also be named by one."""
    log = box / ".steps" / "imports.log"
    used = set(log.read_text(encoding="utf-8").split()) if log.is_file() else set()
    used.add("main.py")
    texts = "\n".join((box / p).read_text("utf-8", "replace") for p in used if (box / p).is_file())
    problems = []
    for f in ch.files:
        named = not f.path.endswith(".py") and f.path.rsplit("/", 1)[-1] in texts
        ok = f.path in used or named
        if not ok:
            problems.append(
                f"tree {ch.number} holds {f.path} but neither main.py nor the tests "
                f"import it: remove it from the tree or use it"
            )
    return problems


def compare_outputs(
    ch: Chapter, lines: list[str], results: dict[str, RunResult], main: RunResult, timeout: float
) -> list[str]:
    """The running half of property 6: every output block matches its fresh run."""
    problems = []
    for oid, i, fence in find_output_blocks(lines, find_fences(lines)):
        if oid not in results or fence is None:
            continue  # reported by check_output_ids
        result, where = results[oid], f"{ch.page}:{i + 1}"
        if result is main and main.returncode != 0:
            problems.append(f"{where}: output {oid!r} is main.py's, which fails (see [2])")
        elif (failure := result.failure(f"output {oid!r}", timeout)) is not None:
            problems.append(f"{where}: {failure}")
        else:
            old, new = normalise(mask("\n".join(lines[fence.start + 1 : fence.end]))), []
            if not outputs_match("\n".join(old), result.stdout):
                new = normalise(mask(result.stdout))
                diff = list(difflib.unified_diff(old, new, "page", "fresh run", lineterm=""))
                problems.append(
                    f"{where}: output {oid!r} no longer matches a fresh run (masked); run "
                    f"`steps.py pages {ch.number}` if the new output is right\n"
                    + "\n".join(diff[2:32])
                )
    return problems


Verdict = tuple[str, list[str]]  # ("ok" | "FAIL" | "skipped" | "n/a", details)


def check_chapter(book: Book, ch: Chapter, run: bool, timeout: float) -> dict[int, Verdict]:
    """The verdict on each of the eight properties for chapter N."""
    verdicts: dict[int, Verdict] = {}

    def verdict(n: int, problems: list[str], note: str = "") -> None:
        verdicts[n] = ("FAIL", problems) if problems else ("ok", [note] if note else [])

    missing = []
    for f in ch.files:
        try:
            book.content(ch, f)
        except StepsError as exc:
            missing.append(str(exc))
    verdict(1, missing)
    if ch is book.chapters[-1]:
        verdict(4, check_python_tree(book))
    else:
        verdicts[4] = ("n/a", ["only the newest chapter"])
    verdict(5, check_page(book, ch))
    verdict(8, check_hashes(book, ch))
    try:
        lines = read_page(book, ch)
        ids = check_output_ids(ch, lines)
    except StepsError as exc:
        lines, ids = [], [str(exc)]
    if not run or missing:
        why = "--no-run" if not run else "the tree does not materialise"
        verdicts.update({n: ("skipped", [why]) for n in (2, 3, 7)})
        verdict(6, ids, f"ids only, {why}")
        return verdicts
    with tempfile.TemporaryDirectory(prefix=f"steps-ch{ch.number:02d}-") as tmp:
        box = Path(tmp)
        prepare_sandbox(book, ch, box)
        main = RunResult(1, "", f"tree {ch.number} has no main.py")
        if ch.file("main.py") is not None:
            main = run_command(book, ["python", "main.py"], box, True, timeout)
        main_failure = main.failure("main.py", timeout)
        verdict(2, [main_failure] if main_failure else [])
        tests_failure = None
        if any(f.path.startswith("tests/") for f in ch.files):
            cmd = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
            tests = run_command(book, cmd, box, True, timeout)
            tests_failure = tests.failure("pytest", timeout)
            verdict(3, [tests_failure] if tests_failure else [], normalise(tests.stdout)[-1])
        else:
            verdicts[3] = ("ok", ["no tests in the tree"])
        if main_failure or tests_failure:
            verdicts[7] = ("skipped", ["main or tests failed"])
        else:
            verdict(7, check_used(book, ch, box))
        results = run_outputs(book, ch, box, timeout, {("tree", ("python", "main.py")): main})
        verdict(6, ids + compare_outputs(ch, lines, results, main, timeout))
    return verdicts


def cmd_check(book: Book, numbers: list[int], run: bool, timeout: float) -> int:
    chapters = [book.get(n) for n in numbers] if numbers else book.chapters
    if not chapters:
        print(f"no chapters: no chapters/chNN_slug/tree.toml under {book.root}")
    counts = {"ok": 0, "FAIL": 0, "skipped": 0, "n/a": 0}
    for ch in chapters:
        print(f"chapter {ch.number} ({ch.folder.name}): {ch.title}", flush=True)
        verdicts = check_chapter(book, ch, run, timeout)
        for n in sorted(verdicts):
            status, details = verdicts[n]
            counts[status] += 1
            head = f"  [{n}] {PROPERTIES[n]:<22} {status}"
            if status == "FAIL":
                for detail in details:
                    print(f"{head}: " + detail.replace("\n", "\n        "))
                    head = " " * (len(head) - 4) + "FAIL"
            else:
                print(head + (f" ({details[0]})" if details and details[0] else ""))
        sys.stdout.flush()
    print(f"summary: {counts['ok']} ok, {counts['FAIL']} failed, {counts['skipped']} skipped")
    return 1 if counts["FAIL"] else 0


# ---------------------------------------------------------------------------- other commands


def regenerate_page(book: Book, ch: Chapter, timeout: float, force: bool = False) -> bool:
    """Rewrite the tree block and the output blocks of chapter N's page; False on failure.
    An output block that still matches after masking is kept unless `force` (new numbers)."""
    lines = read_page(book, ch)
    edits: list[tuple[int, int, list[str]]] = []  # replace lines[a:b] by new lines
    try:
        begin, end, _ = find_tree_block(lines, find_fences(lines))
    except StepsError as exc:
        raise StepsError(f"{ch.page}: {exc}") from None
    edits.append((begin + 1, end, ["```text", *tree_text(ch).split("\n"), "```"]))
    ok = True
    blocks = find_output_blocks(lines, find_fences(lines))
    if blocks:
        with tempfile.TemporaryDirectory(prefix=f"steps-ch{ch.number:02d}-") as tmp:
            prepare_sandbox(book, ch, Path(tmp))
            results = run_outputs(book, ch, Path(tmp), timeout, {})
        for oid, i, fence in blocks:
            if oid not in results:
                print(f"{ch.page}:{i + 1}: unknown output id {oid!r}", file=sys.stderr)
                ok = False
                continue
            result = results[oid]
            if (fail := result.failure(f"output {oid!r}", timeout)) is not None:
                print(f"{ch.page}:{i + 1}: {fail}", file=sys.stderr)
                ok = False
                continue
            if fence is None:
                edits.append((i + 1, i + 1, ["```text", *normalise(result.stdout), "```"]))
                continue
            old = lines[fence.start + 1 : fence.end]
            if not force and outputs_match("\n".join(old), result.stdout):
                continue
            new = normalise(result.stdout)
            for k, line in enumerate(old[: len(new)]):
                if MASK_LINE in line and MASK_LINE not in new[k]:
                    new[k] += f"  {MASK_LINE}"
            edits.append((fence.start + 1, fence.end, new))
    for a, b, new in sorted(edits, reverse=True):
        lines[a:b] = new
    (book.root / ch.page).write_text("\n".join(lines), encoding="utf-8")
    return ok


def cmd_build(book: Book, number: int, dest: Path) -> int:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StepsError(f"{dest} exists and is not an empty folder")
    ch = book.get(number)
    for f in ch.files:
        book.content(ch, f)  # fail before writing anything
    dest.mkdir(parents=True, exist_ok=True)
    book.materialise(ch, dest)
    print(f"tree {number}: {len(ch.files)} files written to {dest}")
    return 0


def cmd_run(book: Book, number: int, args: list[str], timeout: float) -> int:
    ch = book.get(number)
    with tempfile.TemporaryDirectory(prefix=f"steps-ch{number:02d}-") as tmp:
        prepare_sandbox(book, ch, Path(tmp))
        result = run_command(
            book, ["python", "main.py", *args], Path(tmp), True, timeout, capture=False
        )
    if result.returncode is None:
        print(f"main.py timed out after {timeout:g} s", file=sys.stderr)
        return 1
    return result.returncode


def cmd_rehash(book: Book, number: int) -> int:
    ch = book.get(number)
    prev = previous_hashes(book, ch)
    for f in ch.files:
        old = (f.hash, f.status)
        f.hash = git_blob_hash(book.content(ch, f))
        f.status = derived_status(f, prev)
        if (f.hash, f.status) != old:
            print(f"tree {number}: {f.path}: {old[1]} {old[0][:10]} -> {f.status} {f.hash[:10]}")
    write_manifest(ch)
    return 0


def cmd_freeze(book: Book) -> int:
    errors = []
    for ch in book.chapters:
        for f in ch.files:
            stored, live = book.stored_path(ch, f), book.live_path(ch, f)
            if stored.exists() or (live.is_file() and git_blob_hash(live.read_bytes()) == f.hash):
                continue
            try:
                got = subprocess.run(
                    ["git", "cat-file", "blob", f.hash],
                    cwd=book.root,
                    capture_output=True,
                    check=False,
                )
            except FileNotFoundError:
                raise StepsError("freeze needs git, which is not installed") from None
            if got.returncode != 0 or git_blob_hash(got.stdout) != f.hash:
                errors.append(
                    f"chapter {ch.number}: {f.path}: git does not have the recorded blob {f.hash}, "
                    f"so its old content is lost; restore it by hand into {book.rel(stored)}, or "
                    f"run `steps.py rehash {ch.number}` if chapter {ch.number} was meant to change"
                )
                continue
            stored.parent.mkdir(parents=True, exist_ok=True)
            stored.write_bytes(got.stdout)
            print(f"froze {book.rel(stored)}")
    for error in errors:
        print(f"steps.py: error: {error}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steps.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository to work on (default: the one holding this file)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "list": "one line per chapter",
        "tree": "print tree N's file tree block",
        "build": "materialise tree N into DIR",
        "diff": "diff from tree N-1 to tree N",
        "run": "run chapter N's main in isolation",
        "check": "check the eight properties",
        "pages": "regenerate the tree and output blocks of the pages",
        "rehash": "record tree N's current hashes",
        "freeze": "store old copies of files edited by later chapters",
    }
    for name, text in commands.items():
        p = sub.add_parser(name, help=text)
        if name in ("tree", "build", "diff", "run", "rehash"):
            p.add_argument("n", type=int, metavar="N")
        if name in ("check", "pages"):
            p.add_argument("n", type=int, nargs="*", metavar="N", help="default: every chapter")
        if name in ("run", "check", "pages"):
            p.add_argument(
                "--timeout",
                type=float,
                default=DEFAULT_TIMEOUT,
                help="seconds per command (default %(default)g)",
            )
    sub.choices["build"].add_argument("dir", type=Path, metavar="DIR")
    sub.choices["run"].add_argument("args", nargs=argparse.REMAINDER, help="after --: for main.py")
    sub.choices["pages"].add_argument(
        "--force", action="store_true", help="rewrite output blocks even if only numbers changed"
    )
    sub.choices["check"].add_argument(
        "--no-run", action="store_true", help="skip properties 2, 3, 6 and 7"
    )
    args = parser.parse_args(argv)
    try:
        book = Book(args.root)
        if args.command == "list":
            for ch in book.chapters:
                print(
                    f"{ch.number:2d}  {ch.slug:<16} {ch.title}  ({len(ch.files)} files, {ch.page})"
                )
        elif args.command == "tree":
            print(tree_text(book.get(args.n)))
        elif args.command == "build":
            return cmd_build(book, args.n, args.dir)
        elif args.command == "diff":
            sys.stdout.write(diff_text(book, book.get(args.n)))
        elif args.command == "run":
            extra = args.args[1:] if args.args[:1] == ["--"] else args.args
            return cmd_run(book, args.n, extra, args.timeout)
        elif args.command == "check":
            return cmd_check(book, args.n, not args.no_run, args.timeout)
        elif args.command == "pages":
            chapters = [book.get(n) for n in args.n] if args.n else book.chapters
            ok = [regenerate_page(book, ch, args.timeout, args.force) for ch in chapters]
            return 0 if all(ok) else 1
        elif args.command == "rehash":
            return cmd_rehash(book, args.n)
        elif args.command == "freeze":
            return cmd_freeze(book)
    except StepsError as exc:
        print(f"steps.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
