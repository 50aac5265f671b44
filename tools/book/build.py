"""Writing tree N to a folder; diffing trees; `record`, which re-derives deltas and digests
(chapter 0)."""

from __future__ import annotations

import ast
import atexit
import difflib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from book import delta
from book.manifest import Book, Chapter, StepsError, live_rel, owned, tree_digest, write_digest


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
    """`steps.py build N DIR`: tree N for a reader, with models linked, ready to run. A tree
    that is not the one recorded (its digest differs) is written all the same, with a warning:
    a delta holds none of its successor's lines, so a stale one can give a wrong tree."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StepsError(f"{dest} exists and is not an empty folder")
    ch = book.get(number)
    tree = book.tree(ch)  # fail before creating anything
    if ch.digest is not None and tree_digest(tree) != ch.digest:
        print(
            f"steps.py: warning: tree {number} is not the tree recorded in "
            f"chapters/{ch.folder.name}/chapter.toml (its digest differs): something changed "
            f"since `steps.py record`; `steps.py check --no-run {number}` says what to do "
            f"(property 8)",
            file=sys.stderr,
        )
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


def head_book(book: Book) -> Book:
    """The book as committed at git HEAD, unpacked into a temporary folder (kept until exit)."""
    tmp = Path(tempfile.mkdtemp(prefix="steps-record-head-"))
    atexit.register(shutil.rmtree, tmp, True)
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", "HEAD"], cwd=book.root, capture_output=True
        )
    except FileNotFoundError:
        raise StepsError("record needs git to recover older trees, and git is missing") from None
    if archive.returncode != 0:
        raise StepsError(f"git archive HEAD failed: {archive.stderr.decode(errors='replace')}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    return Book(tmp)


def target_tree(book: Book, ch: Chapter, head: list[Book | None]) -> dict[str, bytes]:
    """Tree K as recorded: the working copy's when its digest matches, else git HEAD's."""
    try:
        tree = book.tree(ch)
    except StepsError:
        tree = None
    if ch.digest is None and tree is not None:
        return tree  # a chapter new to the book: what it materialises to now
    if tree is not None and tree_digest(tree) == ch.digest:
        return tree
    if ch is book.chapters[-1]:
        raise StepsError(
            f"tree {ch.number} (newest) is the live code, which changed since it was recorded: "
            f"run `steps.py record` first"
        )
    why = ""
    try:
        if head[0] is None:
            head[0] = head_book(book)
        old = head[0].tree(head[0].get(ch.number))
    except StepsError as exc:
        old, why = None, f" ({exc})"
    if old is None or tree_digest(old) != ch.digest:
        raise StepsError(
            f"tree {ch.number} matches its recorded digest neither in the working copy nor at "
            f"git HEAD{why}, so what it is meant to be is lost; `steps.py record {ch.number}` "
            f"if its current content is right"
        )
    for f in ch.files:
        whole = (ch.folder / f.path).is_file()  # an owned file edited in place
        if owned(f.path) and whole and f.path in old and old[f.path] != book.content_at(ch, f.path):
            raise StepsError(
                f"chapter {ch.number}: {f.path} changed since it was recorded: run `steps.py "
                f"record {ch.number}` if that was meant"
            )
    return old


def live_tree(book: Book, ch: Chapter) -> dict[str, bytes]:
    """The newest tree by definition: the live code, whatever its chapter's delta says."""
    tree = {}
    for f in ch.files:
        if owned(f.path):
            tree[f.path] = book.content_at(ch, f.path)
        elif (book.root / live_rel(f.path)).is_file():
            tree[f.path] = (book.root / live_rel(f.path)).read_bytes()
        else:
            raise StepsError(f"tree {ch.number} (newest) holds {f.path}, which has no live copy")
    return tree


def owned_modes(
    chapters: list[Chapter], trees: list[dict[str, bytes]]
) -> dict[tuple[int, str], str]:
    """How each chapter-owned file of each tree is stored, {(index, path): mode}: "inherit" when
    it equals tree N-1's; else "delta" (a section of chapter N's delta.patch against tree N+1's
    copy) when tree N+1 holds the path without inheriting it and the section is shorter than
    the file; else "whole" (chapters/chNN_slug/<path>). Decided from the newest tree down, so a
    delta never leans on a copy that leans back on it."""
    modes: dict[tuple[int, str], str] = {}
    for k in reversed(range(len(chapters))):
        for path, data in trees[k].items():
            if not owned(path):
                continue
            nxt = trees[k + 1] if k + 1 < len(trees) else {}
            if k and trees[k - 1].get(path) == data:
                modes[k, path] = "inherit"
            elif path in nxt and modes[k + 1, path] != "inherit" and _shorter_as_delta(
                chapters[k + 1].number, path, data, nxt[path]
            ):
                modes[k, path] = "delta"
            else:
                modes[k, path] = "whole"
    return modes


def _shorter_as_delta(m: int, path: str, data: bytes, succ: bytes) -> bool:
    try:
        old = delta.decode_text(data, path)
        new = delta.decode_text(succ, delta.tree_label(m, path))
    except delta.DeltaError:
        return False  # not text: stored whole
    return delta.section_length(path, old, new, delta.tree_label(m, path)) < old.count("\n")


def _must_parse(ch: Chapter, tree: dict[str, bytes]) -> None:
    """`record --all` takes every tree as it now materialises. A reverse hunk of a file that the
    live edit moved lands by line number, not by content, and can leave a broken tree: refuse
    any whose Python does not parse (a wrong tree that still parses is not caught here)."""
    for path, data in sorted(tree.items()):
        if path.endswith(".py"):
            try:
                ast.parse(data, path)
            except SyntaxError as exc:
                raise StepsError(
                    f"record --all: tree {ch.number}'s {path} would not parse (line {exc.lineno}: "
                    f"{exc.msg}): chapter {ch.number}'s delta.patch no longer fits the edited "
                    f"file. Nothing was written. Undo the live edit, `build {ch.number} DIR`, "
                    f"make the edit there as well, redo it live, `record`, then "
                    f"`record {ch.number} DIR`"
                ) from None


def record(book: Book, number: int | None, src: Path | None, every: bool = False) -> int:
    """`steps.py record [N [DIR]]`: make tree N what it is now (or what DIR holds), keep every
    other tree as recorded, re-derive every delta.patch and write N's digest. `record --all`:
    make every tree what it is now (an edit meant for several trees, such as a shared test
    helper, a manifest change or a merge), re-derive the deltas and write every digest."""
    chapters = book.chapters
    if not chapters:
        raise StepsError("there are no chapters")
    if every:
        if number is not None or src is not None:
            raise StepsError("`record --all` takes no N or DIR")
        trees = [book.tree(ch) for ch in chapters[:-1]] + [live_tree(book, chapters[-1])]
        changed = [(ch, t) for ch, t in zip(chapters, trees) if tree_digest(t) != ch.digest]
        for ch, tree in changed:
            _must_parse(ch, tree)
        for ch, tree in changed:
            write_digest(ch, digest := tree_digest(tree))
            print(f"tree {ch.number}: digest {digest}")
        return record(Book(book.root), None, None)
    target = book.get(number) if number is not None else chapters[-1]
    if src is not None and target is chapters[-1]:
        raise StepsError(
            f"tree {target.number} (newest) is the live code: edit it in place, then run "
            f"`steps.py record`"
        )
    head: list[Book | None] = [None]
    trees: list[dict[str, bytes]] = []
    for ch in chapters:
        if ch is not target:
            trees.append(target_tree(book, ch, head))
        elif src is None and ch is chapters[-1]:
            trees.append(live_tree(book, ch))
        elif src is None:
            trees.append(book.tree(ch))
        else:
            missing = [f.path for f in ch.files if not (src / f.path).is_file()]
            if missing:
                raise StepsError(f"{src} lacks {', '.join(missing)} of tree {ch.number}")
            trees.append({f.path: (src / f.path).read_bytes() for f in ch.files})
    modes = owned_modes(chapters, trees)
    for k, ch in enumerate(chapters):
        for path in sorted(p for p in trees[k] if owned(p)):
            own = ch.folder / path
            if modes[k, path] == "whole":
                if not own.is_file() or own.read_bytes() != trees[k][path]:
                    own.write_bytes(trees[k][path])
                    print(f"wrote {book.rel(own)}")
            elif own.is_file():
                own.unlink()
                how = "as tree N-1's" if modes[k, path] == "inherit" else f"in {ch.patch.name}"
                print(f"removed {book.rel(own)} (now stored {how})")
    # the deltas
    for k, ch in enumerate(chapters):
        nxt = trees[k + 1] if k + 1 < len(chapters) else {}
        files = {}
        try:
            for path, data in trees[k].items():
                if owned(path) and modes[k, path] != "delta":
                    continue
                if path in nxt:
                    succ, label = nxt[path], delta.tree_label(chapters[k + 1].number, path)
                elif (book.root / live_rel(path)).is_file():
                    live = book.root / live_rel(path)
                    succ, label = live.read_bytes(), f"repo/{live_rel(path)}"
                else:
                    succ, label = b"", delta.DEV_NULL
                text = delta.decode_text(data, f"tree {ch.number}: {path}")
                files[path] = (text, delta.decode_text(succ, label), label)
            # a file that moved: a rename to its new path when that stores fewer lines
            gone = {p: files[p] for p in files if nxt and p not in nxt}
            if gone:
                m = chapters[k + 1].number
                added = {
                    q: delta.decode_text(blob, delta.tree_label(m, q))
                    for q, blob in nxt.items()
                    if not owned(q) and q not in trees[k]
                }
                for path, moved_to in delta.find_renames(gone, added, m).items():
                    files[path] = (files[path][0], added[moved_to], delta.tree_label(m, moved_to))
        except delta.DeltaError as exc:
            raise StepsError(str(exc)) from None
        text = delta.encode_delta(ch.number, files).encode("utf-8")
        old = ch.patch.read_bytes() if ch.patch.is_file() else b""
        if text != old:
            if text:
                ch.patch.write_bytes(text)
            else:
                ch.patch.unlink()
            print(f"wrote {book.rel(ch.patch)}" + ("" if text else " (removed: empty)"))
    # digests: N's, and any chapter's that had none
    for k, ch in enumerate(chapters):
        digest = tree_digest(trees[k])
        if (ch is target or ch.digest is None) and digest != ch.digest:
            write_digest(ch, digest)
            print(f"tree {ch.number}: digest {digest}")
    # what was written must give back the target trees
    again = Book(book.root)
    for k, ch in enumerate(again.chapters):
        if again.tree(ch) != trees[k]:
            raise StepsError(f"record: tree {ch.number} does not come back as meant (a tool bug)")
    return 0
