"""Prototype for issue 14 ("one source for the code"): trees as reverse deltas from the live code.

A standalone experiment; nothing in tools/book uses it, and it writes nothing into chapters/.

The stored form it proposes, per chapter folder chapters/chNN_slug/:

  chapter.toml   title, page, the tree's digest, the paths tree N adds to and drops from tree
                 N-1 (`new`, `gone`), `early` paths if any, and the outputs (one line each)
  delta.patch    a unified diff, for every shared file of tree N whose content differs from its
                 successor, from tree N (---) to that successor (+++); applied in reverse
  main.py, skeleton.py, naive.py, mutants.toml   as today (chapter-owned, stored whole)

The successor of path P in tree N is P in tree N+1 when tree N+1 holds P, else P's live copy
(`minisgl/...` -> python/minisgl/..., anything else -> the same path at the repository root),
else nothing (the delta then holds the whole file, against /dev/null). A top-level path
(`main.py`, `skeleton.py`, `naive.py`) is chapter-owned: tree N reads chapters/chNN_slug/<path>,
or, when the folder has none, tree N-1's content. The newest chapter has no delta.

What it does (see `--help`):
  1. exports trees 3, 14 and 20 with today's `steps.py build N DIR`;
  2. computes the stored form above for every chapter (0..21) from today's trees and writes it
     under --out (a temporary folder by default);
  3. rebuilds every tree from the live code and what it wrote (never reading tree.toml or
     files/), compares all of them with today's trees and trees 3, 14, 20 with the exports,
     file by file, byte for byte; checks that derived statuses equal the recorded ones;
  4. shows that a stale delta fails loudly and that the digest catches a silent leak, and that
     "record" (re-deriving deltas after a live edit) keeps the older trees unchanged;
  5. counts stored lines, today's and proposed, and times building trees 0 and 3.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from book.manifest import Book, git_blob_hash, toml_string  # noqa: E402

LINE_RE = re.compile(r"[^\n]*\n|[^\n]+\Z")
HUNK_RE = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = "\\ No newline at end of file"


class DeltaError(Exception):
    """A stored delta that does not fit the code it is applied to."""


def split_lines(data: bytes, where: str) -> list[str]:
    """Lines with their "\\n" (the last one may lack it); splits on "\\n" only."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DeltaError(f"{where}: not UTF-8 text ({exc}); a delta needs text") from None
    return LINE_RE.findall(text)


def join_lines(lines: list[str]) -> bytes:
    return "".join(lines).encode("utf-8")


# ---------------------------------------------------------------------------- writing a delta


def unified(old: list[str], new: list[str], a: str, b: str, context: int) -> list[str]:
    """A unified diff from `old` to `new` (patch lines, each ending in "\\n")."""

    def rng(start: int, stop: int) -> str:
        length = stop - start
        return f"{start + 1 if length else start},{length}"

    def emit(tag: str, line: str) -> list[str]:
        if line.endswith("\n"):
            return [tag + line]
        return [tag + line + "\n", NO_NEWLINE + "\n"]

    out = [f"--- {a}\n", f"+++ {b}\n"]
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{rng(i1, i2)} +{rng(j1, j2)} @@\n")
        for tag, k1, k2, m1, m2 in group:
            if tag == "equal":
                for line in old[k1:k2]:
                    out += emit(" ", line)
                continue
            for line in old[k1:k2]:
                out += emit("-", line)
            for line in new[m1:m2]:
                out += emit("+", line)
    return out


# ---------------------------------------------------------------------------- reading a delta


@dataclass
class Hunk:
    header: str
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]] = field(default_factory=list)  # (" " | "-" | "+", line)


@dataclass
class FileDelta:
    path: str  # path in the tree
    old_label: str  # "treeNN/<path>"
    new_label: str  # "treeMM/<path>", "repo/<live path>" or "/dev/null"
    hunks: list[Hunk]


def parse_patch(text: str, where: str) -> dict[str, FileDelta]:
    """delta.patch -> {path: FileDelta}; DeltaError naming the line when it is malformed."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    deltas: dict[str, FileDelta] = {}
    i = 0
    while i < len(lines):
        if (
            not lines[i].startswith("--- ")
            or i + 1 >= len(lines)
            or not lines[i + 1].startswith("+++ ")
        ):
            raise DeltaError(f"{where}:{i + 1}: expected a '--- treeNN/path' header")
        old_label, new_label = lines[i][4:], lines[i + 1][4:]
        path = old_label.split("/", 1)[1] if "/" in old_label else ""
        if path in deltas or not path:
            raise DeltaError(f"{where}:{i + 1}: bad or repeated file {old_label!r}")
        fd = FileDelta(path, old_label, new_label, [])
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK_RE.match(lines[i])
            if not m:
                raise DeltaError(f"{where}:{i + 1}: bad hunk header {lines[i]!r}")
            nums = [int(x) if x is not None else 1 for x in m.groups()]
            hunk = Hunk(lines[i], *nums)
            i += 1
            olds = news = 0
            while olds < hunk.old_len or news < hunk.new_len:
                if i >= len(lines) or lines[i][:1] not in (" ", "-", "+"):
                    raise DeltaError(f"{where}:{i + 1}: hunk {hunk.header} is cut short")
                tag, body = lines[i][0], lines[i][1:] + "\n"
                i += 1
                if i < len(lines) and lines[i] == NO_NEWLINE:
                    body = body[:-1]
                    i += 1
                hunk.lines.append((tag, body))
                olds += tag in " -"
                news += tag in " +"
            if (olds, news) != (hunk.old_len, hunk.new_len):
                raise DeltaError(f"{where}: hunk {hunk.header} has the wrong line counts")
            fd.hunks.append(hunk)
        deltas[path] = fd
    return deltas


def apply_reverse(fd: FileDelta, successor: list[str], where: str) -> list[str]:
    """Tree N's lines from its successor's, strictly: every hunk must match where it says."""
    out: list[str] = []
    pos = 0
    for k, hunk in enumerate(fd.hunks, 1):
        start = hunk.new_start - 1 if hunk.new_len else hunk.new_start
        want = [body for tag, body in hunk.lines if tag in " +"]
        got = successor[start : start + len(want)]
        if start < pos or got != want:
            bad = next((j for j, (w, g) in enumerate(zip(want, got)) if w != g), len(got))
            line = start + bad + 1
            seen = repr(got[bad].rstrip("\n")) if bad < len(got) else "the end of the file"
            expected = repr(want[bad].rstrip("\n")) if bad < len(want) else "?"
            raise DeltaError(
                f"{where}: {fd.path}: hunk {k} ({hunk.header}) does not fit {fd.new_label}: "
                f"at line {line} it expects {expected} but finds {seen}; the successor changed "
                f"without its delta being re-derived (run `steps.py record`)"
            )
        out += successor[pos:start]
        if len(out) + (1 if hunk.old_len else 0) != hunk.old_start:
            raise DeltaError(f"{where}: {fd.path}: hunk {k} ({hunk.header}) is misnumbered")
        out += [body for tag, body in hunk.lines if tag in " -"]
        pos = start + len(want)
    return out + successor[pos:]


# ---------------------------------------------------------------------------- the stored form


def live_path(path: str) -> str:
    return "python/" + path if path.startswith("minisgl/") else path


def owned(path: str) -> bool:
    """A chapter-owned path (main.py, skeleton.py, naive.py): stored whole in the folder."""
    return "/" not in path


def tree_digest(tree: dict[str, bytes]) -> str:
    body = "".join(f"{git_blob_hash(data)} {path}\n" for path, data in sorted(tree.items()))
    return hashlib.sha1(body.encode("utf-8")).hexdigest()


def encode(
    root: Path, trees: list[dict[str, bytes]], folders: list[str], context: int
) -> list[str]:
    """The delta.patch text of each chapter, from the full trees (index = chapter number)."""
    patches = []
    for n, tree in enumerate(trees):
        out: list[str] = []
        for path in sorted(tree):
            if owned(path):
                continue
            data = tree[path]
            if n + 1 < len(trees) and path in trees[n + 1]:
                succ, label = trees[n + 1][path], f"tree{n + 1:02d}/{path}"
            elif (root / live_path(path)).is_file():
                succ, label = (root / live_path(path)).read_bytes(), f"repo/{live_path(path)}"
            else:
                succ, label = b"", "/dev/null"
            if succ == data and label != "/dev/null":
                continue
            where = f"chapters/{folders[n]}: {path}"
            old, new = split_lines(data, where), split_lines(succ, where)
            out += unified(old, new, f"tree{n:02d}/{path}", label, context)
        patches.append("".join(out))
    return patches


def manifest_text(book: Book, n: int, trees: list[dict[str, bytes]]) -> str:
    """chapter.toml: what the live code cannot say, and no status or per-file hash."""
    ch = book.chapters[n]
    prev = trees[n - 1] if n else {}
    q = toml_string
    lines = [f"title = {q(ch.title)}", f"page = {q(ch.page)}"]
    lines.append(f"digest = {q(tree_digest(trees[n]))}  # of tree {n}; written by steps.py")
    for key, paths in (
        ("new", sorted(trees[n].keys() - prev.keys())),
        ("gone", sorted(prev.keys() - trees[n].keys())),
        ("early", sorted(f.path for f in ch.files if f.status == "early")),
    ):
        if paths:
            lines += [f"{key} = ["] + [f"  {q(p)}," for p in paths] + ["]"]
    if ch.outputs:
        lines.append("output = [")
        for o in ch.outputs:
            parts = [f"id = {q(o.id)}", "cmd = [" + ", ".join(q(a) for a in o.cmd) + "]"]
            parts += [f"where = {q(o.where)}"] if o.where != "tree" else []
            parts += [f"results = {q(o.results)}"] if o.results is not None else []
            lines.append("  { " + ", ".join(parts) + " },")
        lines.append("]")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- rebuilding trees


class DeltaBook:
    """Trees rebuilt from the live code at `root` plus the stored form under `store`; reads
    nothing else (no tree.toml, no files/). `overlay` replaces live files (path -> bytes) to
    simulate an edit without touching the repository."""

    def __init__(self, root: Path, store: Path, overlay: dict[str, bytes] | None = None) -> None:
        self.root, self.store, self.overlay = root, store, overlay or {}
        self.folders = sorted(p.name for p in (store / "chapters").glob("ch[0-9][0-9]_*"))
        self.meta = [
            tomllib.loads((store / "chapters" / f / "chapter.toml").read_text("utf-8"))
            for f in self.folders
        ]
        self.deltas = []
        for f in self.folders:
            patch = store / "chapters" / f / "delta.patch"
            text = patch.read_text("utf-8") if patch.is_file() else ""
            self.deltas.append(parse_patch(text, f"chapters/{f}/delta.patch"))
        self.paths: list[set[str]] = []
        for n, meta in enumerate(self.meta):
            prev = self.paths[-1] if n else set()
            gone = set(meta.get("gone", []))
            if not gone <= prev:
                raise DeltaError(f"chapters/{self.folders[n]}: gone names {gone - prev}")
            self.paths.append((prev - gone) | set(meta.get("new", [])))
        self.cache: dict[tuple[int, str], bytes] = {}

    def live(self, rel: str) -> bytes | None:
        if rel in self.overlay:
            return self.overlay[rel]
        p = self.root / rel
        return p.read_bytes() if p.is_file() else None

    def content(self, n: int, path: str) -> bytes:
        key = (n, path)
        if key in self.cache:
            return self.cache[key]
        where = f"chapters/{self.folders[n]}/delta.patch"
        if owned(path):
            data = self.live(f"chapters/{self.folders[n]}/{path}")
            if data is None:
                if n == 0 or path not in self.paths[n - 1]:
                    raise DeltaError(f"chapters/{self.folders[n]}: {path} is missing")
                data = self.content(n - 1, path)
        else:
            if n + 1 < len(self.paths) and path in self.paths[n + 1]:
                succ, label = self.content(n + 1, path), f"tree{n + 1:02d}/{path}"
            elif (live := self.live(live_path(path))) is not None:
                succ, label = live, f"repo/{live_path(path)}"
            else:
                succ, label = b"", "/dev/null"
            fd = self.deltas[n].get(path)
            if fd is None:
                if label == "/dev/null":
                    raise DeltaError(f"{where}: {path} has no successor and no stored text")
                data = succ
            else:
                if fd.new_label != label:
                    raise DeltaError(
                        f"{where}: {path}: the delta is against {fd.new_label} but the "
                        f"successor is now {label}"
                    )
                data = join_lines(apply_reverse(fd, split_lines(succ, where), where))
        self.cache[key] = data
        return data

    def tree(self, n: int) -> dict[str, bytes]:
        return {p: self.content(n, p) for p in sorted(self.paths[n])}

    def digest_ok(self, n: int) -> bool:
        return tree_digest(self.tree(n)) == self.meta[n]["digest"]

    def statuses(self, n: int) -> dict[str, str]:
        prev = self.tree(n - 1) if n else {}
        early = set(self.meta[n].get("early", []))
        return {
            p: "early"
            if p in early
            else "new"
            if p not in prev
            else ("same" if prev[p] == data else "modified")
            for p, data in self.tree(n).items()
        }


# ---------------------------------------------------------------------------- the experiment


def count_lines(paths: list[Path]) -> int:
    return sum(p.read_bytes().count(b"\n") for p in paths if p.is_file())


def export(root: Path, n: int, dest: Path) -> dict[str, bytes]:
    """Tree N as today's `steps.py build N DIR` writes it (links to models/ left out)."""
    cmd = [sys.executable, str(root / "tools" / "steps.py"), "build", str(n), str(dest)]
    subprocess.run(cmd, check=True, capture_output=True)
    return {
        p.relative_to(dest).as_posix(): p.read_bytes()
        for p in sorted(dest.rglob("*"))
        if p.is_file() and not p.is_symlink() and not any(q.is_symlink() for q in p.parents)
    }


def compare(name: str, want: dict[str, bytes], got: dict[str, bytes]) -> list[str]:
    problems = [f"{name}: {p} missing from the rebuild" for p in sorted(want.keys() - got.keys())]
    problems += [f"{name}: {p} extra in the rebuild" for p in sorted(got.keys() - want.keys())]
    problems += [
        f"{name}: {p} differs" for p in sorted(want.keys() & got.keys()) if want[p] != got[p]
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--out", type=Path, help="where to write the stored form (default: temp)")
    parser.add_argument("--context", type=int, default=1, help="context lines (default 1)")
    parser.add_argument("--chapters", type=int, nargs="*", default=[3, 14, 20])
    args = parser.parse_args(argv)
    root = args.root.resolve()
    work = Path(tempfile.mkdtemp(prefix="delta-proto-"))
    out = args.out.resolve() if args.out else work / "store"
    problems: list[str] = []

    # 1. today's trees: three through the command line, all of them through the same API
    exported = {n: export(root, n, work / f"export{n:02d}") for n in args.chapters}
    book = Book(root)
    numbers = [c.number for c in book.chapters]
    assert numbers == list(range(len(numbers))), "the prototype expects chapters 0..N"
    trees = [{f.path: book.content(ch, f) for f in ch.files} for ch in book.chapters]
    for n, tree in exported.items():
        problems += compare(f"export of tree {n} vs Book", tree, trees[n])
    print(f"exported trees {args.chapters} with `steps.py build`; {len(trees)} trees in all")

    # 2. the stored form for every chapter
    folders = [ch.folder.name for ch in book.chapters]
    patches = encode(root, trees, folders, args.context)
    for n, folder in enumerate(folders):
        dest = out / "chapters" / folder
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "chapter.toml").write_text(manifest_text(book, n, trees), encoding="utf-8")
        if patches[n]:
            (dest / "delta.patch").write_text(patches[n], encoding="utf-8")
    print(f"wrote the stored form (context {args.context}) under {out}")

    # 3. rebuild from the live code and the stored form only
    t0 = time.perf_counter()
    db = DeltaBook(root, out)
    db.tree(0)
    t_tree0 = time.perf_counter() - t0
    t0 = time.perf_counter()
    DeltaBook(root, out).tree(3)
    t_tree3 = time.perf_counter() - t0
    compared = 0
    for n in range(len(trees)):
        got = db.tree(n)
        problems += compare(f"tree {n} rebuilt vs today", trees[n], got)
        compared += len(got)
        if n in exported:
            problems += compare(f"tree {n} rebuilt vs `steps.py build {n}`", exported[n], got)
            print(
                f"tree {n}: {len(got)} files rebuilt, byte-identical: "
                f"{not compare('', exported[n], got)}"
            )
        if not db.digest_ok(n):
            problems.append(f"tree {n}: digest differs from the recorded one")
        recorded = {f.path: f.status for f in book.chapters[n].files}
        for p, s in db.statuses(n).items():
            if recorded[p] != s:
                problems.append(f"tree {n}: {p}: derived status {s}, recorded {recorded[p]}")
    print(
        f"all {len(trees)} trees rebuilt and compared: {compared} files; "
        f"tree 0 in {t_tree0 * 1000:.0f} ms, tree 3 in {t_tree3 * 1000:.0f} ms (cold, "
        f"parsing every delta)"
    )

    # 4a. a stale delta fails loudly: edit, in memory, a live line that chapter 20's delta needs
    target = next(
        (path, fd) for path, fd in db.deltas[len(trees) - 2].items() if fd.new_label != "/dev/null"
    )
    path, fd = target
    live_rel = (
        fd.new_label.removeprefix("repo/")
        if fd.new_label.startswith("repo/")
        else (live_path(path))
    )
    lines = split_lines(db.live(live_rel) or b"", live_rel)
    hunk = fd.hunks[0]
    k = hunk.new_start - 1 if hunk.new_len else hunk.new_start
    k = min(k, len(lines) - 1)
    lines[k] = "# an edit nobody recorded\n" + lines[k]
    stale = DeltaBook(root, out, {live_rel: join_lines(lines)})
    try:
        stale.tree(len(trees) - 2)
        problems.append("a stale delta was applied without complaint")
    except DeltaError as exc:
        print(f"stale delta, as reported: {exc}")

    # 4b. an edit far from any hunk leaks silently into older trees: the digest catches it
    leak_path = next(p for p in sorted(trees[0]) if not owned(p) and p in trees[-1])
    rel = live_path(leak_path)
    leaked = DeltaBook(root, out, {rel: (db.live(rel) or b"") + b"# leaked\n"})
    bad = [n for n in range(len(trees)) if leak_path in leaked.paths[n] and not leaked.digest_ok(n)]
    print(f"live edit of {rel} without record: digests flag trees {bad}")
    if not bad:
        problems.append("the digest missed a leaked edit")

    # 4c. "record" after a live edit: tree 21 takes the edit, deltas re-derived, older trees kept
    edited = dict(trees[-1])
    edited[leak_path] = edited[leak_path] + b"# a chapter-21 edit\n"
    new_trees = trees[:-1] + [edited]
    overlay = {rel: edited[leak_path]}
    rec = work / "recorded"
    patches2 = encode_with_overlay(root, overlay, new_trees, folders, args.context)
    for n, folder in enumerate(folders):
        dest = rec / "chapters" / folder
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "chapter.toml").write_text(manifest_text(book, n, new_trees), encoding="utf-8")
        if patches2[n]:
            (dest / "delta.patch").write_text(patches2[n], encoding="utf-8")
    after = DeltaBook(root, rec, overlay)
    kept = all(after.tree(n) == trees[n] for n in range(len(trees) - 1))
    changed = [f"{folders[n]}/delta.patch" for n in range(len(trees)) if patches[n] != patches2[n]]
    print(
        f"record after a live edit of {rel}: older trees unchanged: {kept}; "
        f"deltas rewritten: {changed}"
    )
    if not kept:
        problems.append("record changed an older tree")

    # 5. stored lines
    chapters = root / "chapters"
    today_tree = count_lines(sorted(chapters.glob("*/tree.toml")))
    today_files = count_lines(sorted(p for p in chapters.glob("*/files/**/*") if p.is_file()))
    n_files = sum(1 for p in chapters.glob("*/files/**/*") if p.is_file())
    whole = sorted(p for p in chapters.glob("*/*") if p.is_file() and p.name not in ("tree.toml",))
    today_whole = count_lines(whole)
    new_manifest = count_lines(sorted(out.glob("chapters/*/chapter.toml")))
    new_delta = count_lines(sorted(out.glob("chapters/*/delta.patch")))
    sub = [n for n in range(3, len(trees))]
    sub_delta = count_lines([out / "chapters" / folders[n] / "delta.patch" for n in sub])
    sub_manifest = count_lines([out / "chapters" / folders[n] / "chapter.toml" for n in sub])
    print("stored lines under chapters/:")
    print(
        f"  today:    tree.toml {today_tree} + files/ {today_files} ({n_files} frozen files) "
        f"= {today_tree + today_files}"
    )
    print(
        f"  proposed: chapter.toml {new_manifest} + delta.patch {new_delta} "
        f"= {new_manifest + new_delta}  (chapters 3..21 only: {sub_manifest + sub_delta})"
    )
    print(f"  both keep whole: main.py, skeleton.py, naive.py, mutants.toml = {today_whole}")
    print(
        f"  everything under chapters/: today {today_tree + today_files + today_whole}, "
        f"proposed {new_manifest + new_delta + today_whole}"
    )
    for p in problems:
        print(f"PROBLEM: {p}")
    print("result:", "all byte-identical" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


def encode_with_overlay(
    root: Path,
    overlay: dict[str, bytes],
    trees: list[dict[str, bytes]],
    folders: list[str],
    context: int,
) -> list[str]:
    """encode() with some live files replaced (a live edit simulated in memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        shadow = Path(tmp)
        paths = {live_path(p) for t in trees for p in t if not owned(p)}
        for rel in paths:
            data = overlay.get(rel)
            if data is None and (root / rel).is_file():
                data = (root / rel).read_bytes()
            if data is not None:
                (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
                (shadow / rel).write_bytes(data)
        return encode(shadow, trees, folders, context)


if __name__ == "__main__":
    sys.exit(main())
