"""The Markdown side of the book: fences, include lines, the tree block, output markers and
count markers (chapter 0).

A page shows code only through include lines (`--8<-- "N:path#name"`, expanded by
tools/mkdocs_hooks.py) and shows tree N between `<!-- tree: begin -->` and `<!-- tree: end -->`.
A number that describes a tree is written `<!-- n: KIND N:path -->VALUE<!-- /n -->` (KIND `lines`:
the file's lines; `nonblank`: those with text; `code`: those with text that are not comments
(docstrings count); `tests`: its test functions; `cases`: the test cases pytest collects from a
test file or folder of tree N, parametrized ones counted apart), so `steps.py pages` writes VALUE
and `check` fails when it is stale (`cases` needs pytest to run: not checked under `--no-run`).
Except for `cases`, path may name a folder of tree N (its .py files) or several paths joined by
commas, and the count is their sum.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from book.manifest import MARKS, Book, Chapter, StepsError, TreeFile

TREE_BEGIN, TREE_END = "<!-- tree: begin -->", "<!-- tree: end -->"
ILLUSTRATION = "<!-- illustration -->"
OUTPUT_RE = re.compile(r"^\s*<!--\s*output:\s*(\S+?)\s*-->\s*$")
INCLUDE_RE = re.compile(r'^(\s*)--8<--\s+"([^"]*)"\s*$')
INCLUDE_SPEC_RE = re.compile(r"(repo|\d+):([^#]+?)(?:#([\w.]+)|:(\d+):(\d+))?")
FENCE_RE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
COUNT_RE = re.compile(r"<!-- n: (\w+) (\d+):(\S+) -->([^<]*)<!-- /n -->")
COUNT_KINDS = ("lines", "nonblank", "code", "tests", "cases")
CASES_RE = re.compile(r"^(\d+) tests? collected", re.M)
_CASES: dict[tuple[str, int, str], str] = {}  # (root, N, path) -> cases, once per process
# (root, N) -> the module of each test case that a run of all of tree N's tests went through
_RUN: dict[tuple[str, int], list[str]] = {}


def read_lines(book: Book, page: str) -> list[str]:
    path = book.root / page
    if not path.is_file():
        raise StepsError(f"{page} does not exist (manifest key `page`)")
    return path.read_text(encoding="utf-8").split("\n")


# ---------------------------------------------------------------------------- fences, includes


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


# ---------------------------------------------------------------------------- the tree block


def render_tree(marks: dict[str, str]) -> list[str]:
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
    return [f"{label:<{width}}{mark}".rstrip() for label, mark in rows]


def tree_block(book: Book, ch: Chapter) -> list[str]:
    """What goes between the tree markers: the new, modified and early files as the main tree,
    then the unchanged ones in a folded admonition (mkdocs-material `???`). The statuses are
    computed (Book.statuses)."""
    statuses = book.statuses(ch)
    changed = {p: MARKS[s] for p, s in statuses.items() if s != "same"}
    lines = ["```text", *render_tree(changed), "```"]
    same = {p: "" for p, s in statuses.items() if s == "same"}
    if same:
        folded = ["```text", *render_tree(same), "```"]
        lines += ["", f'??? note "未变的文件（{len(same)} 个）"', ""] + ["    " + x for x in folded]
        lines.append("")  # the admonition ends before the end marker
    return lines


def find_tree_block(lines: list[str]) -> tuple[int, int]:
    """The indices of the begin and end markers; StepsError unless there is one pair."""
    begins = [i for i, line in enumerate(lines) if line.strip() == TREE_BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == TREE_END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise StepsError(f"needs exactly one {TREE_BEGIN} ... {TREE_END} pair")
    return begins[0], ends[0]


# ---------------------------------------------------------------------------- output markers


def find_output_markers(lines: list[str]) -> list[tuple[str, int, Fence | None]]:
    """(id as written, marker line, the ```text fence that follows or None) for each marker."""
    fences = find_fences(lines)
    inside = {i for f in fences for i in range(f.start, f.end + 1)}
    starts = {f.start: f for f in fences}
    markers = []
    for i, line in enumerate(lines):
        m = OUTPUT_RE.match(line)
        if m is None or i in inside:
            continue
        j = next((k for k in range(i + 1, len(lines)) if lines[k].strip()), len(lines))
        fence = starts.get(j)
        markers.append((m[1], i, fence if fence is not None and fence.info == "text" else None))
    return markers


# ---------------------------------------------------------------------------- count markers


def collected_cases(book: Book, number: int, rel: str) -> str:
    """How many test cases `pytest --collect-only` finds at `rel` (a file or folder) in tree N."""
    from book.sandbox import run_command, sandbox  # here: the sandbox builds trees itself

    key = (str(book.root), number, rel)
    if key not in _CASES:
        ch = book.get(number)
        if not any(f.path == rel or f.path.startswith(rel.rstrip("/") + "/") for f in ch.files):
            raise StepsError(f"tree {number} has no {rel} (see `steps.py tree {number}`)")
        modules = _RUN.get((str(book.root), number))
        if modules is not None:  # the cases of the run of all tests: what a collection finds
            dotted = rel.rstrip("/").removesuffix(".py").replace("/", ".")
            found = sum(m == dotted or m.startswith(dotted + ".") for m in modules)
            _CASES[key] = f"{found:,}"
            return _CASES[key]
        cmd = ["python", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", rel]
        with sandbox(book, ch) as box:
            done = run_command(book, cmd, box, 600, isolated=True, log="collect.log")
        found = CASES_RE.search(done.stdout)
        if done.returncode != 0 or found is None:
            raise StepsError(f"tree {number}: pytest could not collect {rel}:\n"
                             + (done.stdout + done.stderr)[-800:])
        _CASES[key] = f"{int(found[1]):,}"
    return _CASES[key]


def note_test_run(book: Book, number: int, junit: Path) -> None:
    """Remember the test cases of a run of all of tree N's tests (pytest's --junitxml report),
    so that `cases` markers on tree N count them instead of collecting again."""
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    _RUN[(str(book.root), number)] = [c.get("classname", "") for c in cases]


def count_value(book: Book, kind: str, number: int, rel: str) -> str:
    """What a count marker stands for, written as the pages write numbers (1,234)."""
    if kind not in COUNT_KINDS:
        raise StepsError(f"unknown count `{kind}` (known: {', '.join(COUNT_KINDS)})")
    if kind == "cases":
        return collected_cases(book, number, rel)
    chapter = book.get(number)
    files = tree_files(chapter, rel, number)
    texts = [book.content(chapter, f).decode("utf-8", "replace") for f in files]
    if kind in ("lines", "nonblank", "code"):
        keep = {"lines": lambda r: True, "nonblank": lambda r: bool(r.strip()),
                "code": lambda r: bool(r.strip()) and not r.lstrip().startswith("#")}[kind]
        return f"{sum(keep(r) for text in texts for r in text.splitlines()):,}"
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    tests = 0
    for f, text in zip(files, texts):
        try:
            nodes = list(ast.walk(ast.parse(text)))
        except SyntaxError as exc:
            raise StepsError(f"tree {number}: {f.path}: cannot parse: {exc}") from None
        tests += sum(isinstance(n, kinds) and n.name.startswith("test_") for n in nodes)
    return f"{tests:,}"


def tree_files(chapter: Chapter, rel: str, number: int) -> list[TreeFile]:
    """The files of tree N that `rel` names: a file, a folder (its .py files), or several
    of these joined by commas."""
    out: list[TreeFile] = []
    for path in rel.split(","):
        f = chapter.file(path)
        inside = [g for g in chapter.files
                  if g.path.startswith(path.rstrip("/") + "/") and g.path.endswith(".py")]
        if f is None and not inside:
            raise StepsError(f"tree {number} has no {path} (see `steps.py tree {number}`)")
        out += [f] if f is not None else sorted(inside, key=lambda g: g.path)
    return out


def fill_counts(
    book: Book, lines: list[str], run: bool = True
) -> tuple[list[str], list[str]]:
    """The lines with every count marker outside fences set to its value, and the problems
    (`line L: ...`) of the markers that name no file or no known count; without `run`, `cases`
    markers (they need pytest) are left as they are."""
    inside = {i for f in find_fences(lines) for i in range(f.start, f.end + 1)}
    out, problems = list(lines), []
    for i, line in enumerate(lines):
        if i in inside or "<!-- n:" not in line:
            continue

        def value(m: re.Match[str], i: int = i) -> str:
            if m[1] == "cases" and not run:
                return m[0]
            try:
                got = count_value(book, m[1], int(m[2]), m[3])
            except StepsError as exc:
                problems.append(f"line {i + 1}: {exc}")
                return m[0]
            return f"<!-- n: {m[1]} {m[2]}:{m[3]} -->{got}<!-- /n -->"

        out[i] = COUNT_RE.sub(value, line)
    return out, problems
