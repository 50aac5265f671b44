"""Writing tree N to a folder; diffing trees, recording hashes, freezing old copies (chapter 0)."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

from book.manifest import Book, Chapter, StepsError, git_blob_hash, write_manifest


def write_tree(book: Book, ch: Chapter, dest: Path) -> None:
    """Write every file of tree N, at its chapter-N content, under `dest`."""
    contents = {f.path: book.content(ch, f) for f in ch.files}  # fail before writing anything
    for path, data in contents.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(data)


def link_models(book: Book, dest: Path, with_maker: bool) -> None:
    """Link `dest/models` to the repository's models/ (what mains and tests load by relative
    path); `with_maker` also links tools/models.py, which tests/conftest.py runs to make a
    missing model when MINISGL_REPO does not point at the repository."""
    models = book.root / "models"
    if with_maker:
        models.mkdir(exist_ok=True)  # so that models made from the tree land in the repository
    if models.exists() and not (dest / "models").exists():
        (dest / "models").symlink_to(models, target_is_directory=True)
    maker = book.root / "tools" / "models.py"
    if with_maker and maker.is_file() and not (dest / "tools" / "models.py").exists():
        (dest / "tools").mkdir(exist_ok=True)
        (dest / "tools" / "models.py").symlink_to(maker)


def build(book: Book, number: int, dest: Path) -> int:
    """`steps.py build N DIR`: tree N for a reader, with models linked, ready to run."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StepsError(f"{dest} exists and is not an empty folder")
    ch = book.get(number)
    for f in ch.files:
        book.content(ch, f)  # fail before creating anything
    dest.mkdir(parents=True, exist_ok=True)
    write_tree(book, ch, dest)
    link_models(book, dest, with_maker=True)
    print(f"tree {number}: {len(ch.files)} files written to {dest}; models/ links to the repo's")
    print(f"run it:\n  cd {dest}")
    if ch.file("main.py"):
        print("  python main.py")
    if any(f.path.startswith("tests/") for f in ch.files):
        print("  python -m pytest -q tests")
    return 0


def diff_text(book: Book, ch: Chapter) -> str:
    """`steps.py diff N`: a unified diff from tree N-1 to tree N."""
    prev = book.previous(ch)
    old = {f.path: book.content(prev, f) for f in prev.files} if prev else {}
    new = {f.path: book.content(ch, f) for f in ch.files}
    out: list[str] = []
    for path in sorted(old.keys() | new.keys()):
        if old.get(path) == new.get(path):
            continue
        a, b = (
            d[path].decode("utf-8", "replace").splitlines(True) if path in d else []
            for d in (old, new)
        )
        names = (
            f"a/{path}" if path in old else "/dev/null",
            f"b/{path}" if path in new else "/dev/null",
        )
        for line in difflib.unified_diff(a, b, *names):
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def rehash(book: Book, number: int) -> int:
    """`steps.py rehash N`: record tree N's current hashes and the statuses they imply."""
    ch = book.get(number)
    prev = book.previous_hashes(ch)
    for f in ch.files:
        old = (f.hash, f.status)
        f.hash = git_blob_hash(book.content(ch, f))
        f.status = f.derived_status(prev)
        if (f.hash, f.status) != old:
            print(f"tree {number}: {f.path}: {old[1]} {old[0][:10]} -> {f.status} {f.hash[:10]}")
    write_manifest(ch)
    return 0


def freeze(book: Book) -> int:
    """`steps.py freeze`: store, from git, the recorded content of each file whose live copy a
    later chapter edited."""
    errors = []
    for ch in book.chapters:
        for f in ch.files:
            stored, source = book.stored_path(ch, f), book.source(ch, f)
            if source.is_file() and git_blob_hash(source.read_bytes()) == f.hash:
                continue  # its own frozen copy, an earlier chapter's, or the live file
            try:
                cmd = ["git", "cat-file", "blob", f.hash]
                got = subprocess.run(cmd, cwd=book.root, capture_output=True, check=False)
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
