"""One-off generator (issue 14, memo step 3): tree.toml + files/ -> chapter.toml + delta.patch.

Run `python tools/book/migrate.py [--root DIR]` on a repository that still has every
chapters/chNN_slug/tree.toml. It reads the trees through today's loader (book.manifest.Book),
writes next to each tree.toml a `chapter.toml` (title, page, the tree's digest, `new`/`gone`
relative to tree N-1, `early`, outputs) and a `delta.patch` (tree N against its successor, 1
line of context, written by book.delta; absent when empty), then verifies, reading nothing but
the live code and what it wrote:
  1. every tree rebuilds byte for byte;
  2. every derived status equals the recorded one;
  3. every page's tree block, rendered from the derived statuses, is unchanged;
  4. every tree's digest equals the one written.
It exits 1 and prints each problem when one fails. It needs the tree.toml loader, so it runs
only on a commit from before the loader switch.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from book import delta  # noqa: E402
from book.manifest import MARKS, Book, git_blob_hash, toml_string  # noqa: E402
from book.pages import render_tree, tree_block  # noqa: E402

CONTEXT = 1


def live_path(path: str) -> str:
    """Where the live copy of a tree path sits in the repository."""
    return "python/" + path if path.startswith("minisgl/") else path


def owned(path: str) -> bool:
    """A chapter-owned path (main.py, skeleton.py, naive.py): stored whole in the folder."""
    return "/" not in path


def tree_digest(tree: dict[str, bytes]) -> str:
    """sha1 over the sorted `blobhash path` lines of a tree."""
    body = "".join(f"{git_blob_hash(data)} {path}\n" for path, data in sorted(tree.items()))
    return hashlib.sha1(body.encode("utf-8")).hexdigest()


def successor(root: Path, trees: list[dict[str, bytes]], n: int, path: str) -> tuple[bytes, str]:
    """(content, `+++` label) of the successor of `path` in tree n."""
    if n + 1 < len(trees) and path in trees[n + 1]:
        return trees[n + 1][path], delta.tree_label(n + 1, path)
    live = root / live_path(path)
    if live.is_file():
        return live.read_bytes(), f"repo/{live_path(path)}"
    return b"", delta.DEV_NULL


def patch_text(root: Path, trees: list[dict[str, bytes]], n: int) -> str:
    files = {}
    for path, data in trees[n].items():
        if owned(path):
            continue
        succ, label = successor(root, trees, n, path)
        where = f"tree {n}: {path}"
        files[path] = (delta.decode_text(data, where), delta.decode_text(succ, where), label)
    return delta.encode_delta(n, files, CONTEXT)


def chapter_toml(book: Book, n: int, trees: list[dict[str, bytes]]) -> str:
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


class Rebuilt:
    """Trees rebuilt from the live code and the written chapter.toml / delta.patch only."""

    def __init__(self, root: Path, folders: list[Path]) -> None:
        self.root, self.folders = root, folders
        self.meta = [tomllib.loads((f / "chapter.toml").read_text("utf-8")) for f in folders]
        self.deltas = []
        for f in folders:
            p = f / "delta.patch"
            self.deltas.append(
                delta.read_patch(p, f"chapters/{f.name}/delta.patch") if p.is_file() else {}
            )
        self.paths: list[set[str]] = []
        for meta in self.meta:
            prev = self.paths[-1] if self.paths else set()
            gone = set(meta.get("gone", []))
            assert gone <= prev, gone - prev
            self.paths.append((prev - gone) | set(meta.get("new", [])))
        self.cache: dict[tuple[int, str], bytes] = {}

    def content(self, n: int, path: str) -> bytes:
        if (n, path) in self.cache:
            return self.cache[n, path]
        folder = self.folders[n]
        if owned(path):
            own = folder / path
            data = own.read_bytes() if own.is_file() else self.content(n - 1, path)
        else:
            if n + 1 < len(self.paths) and path in self.paths[n + 1]:
                succ, label = self.content(n + 1, path), delta.tree_label(n + 1, path)
            elif (self.root / live_path(path)).is_file():
                succ, label = (self.root / live_path(path)).read_bytes(), f"repo/{live_path(path)}"
            else:
                succ, label = b"", delta.DEV_NULL
            section = self.deltas[n].get(path)
            name = f"chapters/{folder.name}/delta.patch"
            if section is None:
                data = succ
            else:
                delta.check_successor(section, label, name)
                text = delta.decode_text(succ, label)
                data = delta.apply_reverse(
                    text, section.hunks, patch=name, path=path, successor=label
                ).encode("utf-8")
        self.cache[n, path] = data
        return data

    def tree(self, n: int) -> dict[str, bytes]:
        return {p: self.content(n, p) for p in sorted(self.paths[n])}

    def statuses(self, n: int) -> dict[str, str]:
        prev = self.tree(n - 1) if n else {}
        early = set(self.meta[n].get("early", []))
        out = {}
        for p, data in self.tree(n).items():
            if p in early:
                out[p] = "early"
            elif p not in prev:
                out[p] = "new"
            else:
                out[p] = "same" if prev[p] == data else "modified"
        return out


def count_lines(paths: list[Path]) -> int:
    return sum(p.read_bytes().count(b"\n") for p in paths if p.is_file())


def block_from(statuses: dict[str, str]) -> list[str]:
    """pages.tree_block's rendering, from a path -> status map."""
    changed = {p: MARKS[s] for p, s in statuses.items() if s != "same"}
    lines = ["```text", *render_tree(changed), "```"]
    same = {p: "" for p, s in statuses.items() if s == "same"}
    if same:
        folded = ["```text", *render_tree(same), "```"]
        lines += ["", f'??? note "未变的文件（{len(same)} 个）"', ""] + ["    " + x for x in folded]
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args(argv)
    root = args.root.resolve()
    book = Book(root)
    numbers = [c.number for c in book.chapters]
    if numbers != list(range(len(numbers))):
        print(f"migrate expects chapters 0..N, found {numbers}", file=sys.stderr)
        return 2
    trees = [{f.path: book.content(ch, f) for f in ch.files} for ch in book.chapters]
    for n, ch in enumerate(book.chapters):
        (ch.folder / "chapter.toml").write_text(chapter_toml(book, n, trees), encoding="utf-8")
        text = patch_text(root, trees, n)
        patch = ch.folder / "delta.patch"
        if text:
            patch.write_bytes(text.encode("utf-8"))
        elif patch.exists():
            patch.unlink()
    print(f"wrote chapter.toml and delta.patch for {len(trees)} chapters")

    problems: list[str] = []
    rebuilt = Rebuilt(root, [ch.folder for ch in book.chapters])
    files = identical = 0
    for n, ch in enumerate(book.chapters):
        got = rebuilt.tree(n)
        want = trees[n]
        problems += [f"tree {n}: {p} missing" for p in sorted(want.keys() - got.keys())]
        problems += [f"tree {n}: {p} extra" for p in sorted(got.keys() - want.keys())]
        for p in sorted(want.keys() & got.keys()):
            files += 1
            if want[p] == got[p]:
                identical += 1
            else:
                problems.append(f"tree {n}: {p} differs")
        if tree_digest(got) != rebuilt.meta[n]["digest"]:
            problems.append(f"tree {n}: digest differs")
        derived = rebuilt.statuses(n)
        for f in ch.files:
            if derived.get(f.path) != f.status:
                problems.append(
                    f"tree {n}: {f.path}: derived {derived.get(f.path)}, recorded {f.status}"
                )
        if block_from(derived) != tree_block(ch):
            problems.append(f"tree {n}: the page's tree block would change")
    chapters = root / "chapters"
    old = count_lines(sorted(chapters.glob("*/tree.toml")))
    old += count_lines(sorted(p for p in chapters.glob("*/files/**/*") if p.is_file()))
    new = count_lines(sorted(chapters.glob("*/chapter.toml")))
    new += count_lines(sorted(chapters.glob("*/delta.patch")))
    print(f"{identical} of {files} files rebuilt byte-identical in {len(trees)} trees")
    print(f"stored tree lines: tree.toml + files/ {old} -> chapter.toml + delta.patch {new}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print("result:", "all identical" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
