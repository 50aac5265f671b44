"""Per-chapter build and check tool for the book (introduced with chapter 0).

Chapter N lives in `chapters/chNN_slug/`: its `chapter.toml` and `delta.patch` describe "tree
N", the code as it stands at the end of chapter N, as a reverse delta from the trees after it
(the newest tree is the live code). This file is only the command line (COMMANDS below, `--help`
for the options); the work is done by the package tools/book/.

After editing the live code: `record`, then `pages` and `check`. After editing chapter N's
main.py or skeleton: `record N`. To fix an older tree N: `build N DIR`, edit there, then
`record N DIR`. After an edit meant for several trees (a shared test helper, a manifest, a
merge): `record --all`. The writing commands (`pages`, `bench`, `record`) refuse to start while
another one runs in the same repository.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from book.build import build, diff_text, record
from book.check import check
from book.index import write_index
from book.manifest import Book, StepsError
from book.mutate import mutate
from book.outputs import bench, regenerate
from book.pages import tree_block
from book.sandbox import run_command, sandbox

DEFAULT_TIMEOUT = 1800.0  # seconds per command
BENCH_TIMEOUT = 7200.0  # a full benchmark on a busy machine
COMMANDS = {
    "list": "one line per chapter",
    "tree": "print tree N's file tree block",
    "build": "materialise tree N into DIR, ready to run",
    "diff": "diff from tree N-1 to tree N",
    "run": "run chapter N's main in isolation",
    "check": "check the eight properties",
    "pages": "regenerate the tree and output blocks of the pages, and the package index",
    "mutate": "list chapter N's mutants, or run one against the tests",
    "bench": "run benchmark output ID in full and record its results file",
    "record": "re-derive every delta keeping other trees; record tree N's digest (default newest)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="steps.py", description=__doc__.split("\n")[0])
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--root", type=Path, default=root, help="repository (default: this one)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if name in ("tree", "build", "diff", "run", "mutate", "bench"):
            p.add_argument("n", type=int, metavar="N")
        if name in ("check", "pages"):
            p.add_argument("n", type=int, nargs="*", metavar="N", help="default: every chapter")
        if name in ("run", "check", "pages", "mutate", "bench"):
            text = "seconds per command (default %(default)g)"
            default = BENCH_TIMEOUT if name == "bench" else DEFAULT_TIMEOUT
            p.add_argument("--timeout", type=float, default=default, help=text)
    sub.choices["build"].add_argument("dir", type=Path, metavar="DIR")
    rec = sub.choices["record"]
    rec.add_argument("n", type=int, nargs="?", metavar="N", help="default: the newest chapter")
    rec.add_argument("dir", type=Path, nargs="?", metavar="DIR", help="tree N's new content")
    rec.add_argument(
        "--all", action="store_true", help="make every tree what it is now (shared files, merges)"
    )
    sub.choices["run"].add_argument("args", nargs=argparse.REMAINDER, help="after --: for main.py")
    sub.choices["mutate"].add_argument("name", nargs="?", metavar="NAME")
    sub.choices["bench"].add_argument("id", metavar="ID")
    sub.choices["pages"].add_argument(
        "--force", action="store_true", help="rewrite output blocks even if only numbers changed"
    )
    sub.choices["pages"].add_argument(
        "--index",
        action="store_true",
        help="only the package index (docs/appendix-index.md; also made when no N is given)",
    )
    sub.choices["check"].add_argument(
        "--no-run", action="store_true", help="skip what needs running (properties 2, 3, 6, 7)"
    )
    sub.choices["check"].add_argument(
        "--jobs", type=int, default=1, metavar="J", help="chapters checked at once (default 1)"
    )
    return parser.parse_args(argv)


def run_main(book: Book, number: int, args: list[str], timeout: float) -> int:
    """`steps.py run N`: chapter N's main in its sandbox, attached to the terminal."""
    args = args[1:] if args[:1] == ["--"] else args
    with sandbox(book, book.get(number)) as box:
        cmd = ["python", "main.py", *args]
        result = run_command(book, cmd, box, timeout, isolated=True, capture=False)
    if result.returncode is None:
        print(f"main.py timed out after {timeout:g} s", file=sys.stderr)
        return 1
    return result.returncode


WRITERS = ("pages", "bench", "record")  # the commands that write pages, results or deltas


@contextlib.contextmanager
def one_writer(root: Path, command: str) -> Iterator[None]:
    """Refuse a second writing command in the same repository while one runs: two `pages` at
    once interleave their writes and leave a page that is neither run's."""
    git = root / ".git"
    where = git if git.is_dir() else Path(tempfile.gettempdir())
    name = "steps-write.lock" if git.is_dir() else (
        f"steps-write-{hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]}.lock")
    with open(where / name, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StepsError(
                f"another `steps.py {'/'.join(WRITERS)}` is running in {root}; wait for it to "
                f"finish before `steps.py {command}`"
            ) from None
        yield


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        book = Book(args.root)
        with one_writer(book.root, args.command) if args.command in WRITERS else (
                contextlib.nullcontext()):
            return dispatch(book, args)
    except StepsError as exc:
        print(f"steps.py: error: {exc}", file=sys.stderr)
        return 2


def dispatch(book: Book, args: argparse.Namespace) -> int:
    """Run the command `args` names; its exit code."""
    if args.command == "list":
        for ch in book.chapters:
            print(
                f"{ch.number:2d}  {ch.slug:<16} {ch.title}  ({len(ch.files)} files, {ch.page})"
            )
    elif args.command == "tree":
        print("\n".join(tree_block(book, book.get(args.n))))
    elif args.command == "build":
        return build(book, args.n, args.dir)
    elif args.command == "diff":
        sys.stdout.write(diff_text(book, book.get(args.n)))
    elif args.command == "run":
        return run_main(book, args.n, args.args, args.timeout)
    elif args.command == "check":
        return check(book, args.n, not args.no_run, args.timeout, args.jobs)
    elif args.command == "pages":
        if args.index or not args.n:
            write_index(book)
        if args.index and not args.n:
            return 0
        chapters = [book.get(n) for n in args.n] if args.n else book.chapters
        return 0 if regenerate(book, chapters, args.timeout, args.force) else 1
    elif args.command == "mutate":
        return mutate(book, args.n, args.name, args.timeout)
    elif args.command == "bench":
        return bench(book, args.n, args.id, args.timeout)
    elif args.command == "record":
        return record(book, args.n, args.dir, every=args.all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
