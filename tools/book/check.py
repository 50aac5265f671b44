"""`steps.py check`: the eight properties every chapter keeps, and the pages' sizes (chapter 0)."""

from __future__ import annotations

import difflib
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from book import pages
from book.delta import DEV_NULL
from book.index import INDEX_PAGE, check_index
from book.manifest import Book, Chapter, StepsError
from book.mutate import check_mutants
from book.outputs import Block, Runner, check_blocks, compare_blocks, find_blocks, normalise
from book.sandbox import RunResult, run_command, sandbox

PROPERTIES = {
    1: "tree materialises",
    2: "main runs",
    3: "tests pass",
    4: "python/minisgl = tree",
    5: "page matches tree",
    6: "outputs match",
    7: "every file used",
    8: "tree recorded",
}
PAGE_WARNING_KB = 45  # a page above this is flagged (not failed): split it or trim it
Verdict = tuple[str, list[str]]  # ("ok" | "FAIL" | "skipped" | "n/a", details)


def check_python_tree(book: Book) -> list[str]:
    """Property 4: the newest tree is the live code: the newest chapter has no delta, and its
    minisgl/ paths are exactly the files under python/minisgl/."""
    ch = book.chapters[-1]
    problems = []
    if ch.patch.exists():
        problems.append(
            f"{book.rel(ch.patch)} exists, so tree {ch.number} (newest) would differ from the "
            f"live code; the newest chapter has no delta: run `steps.py record`"
        )
    tree = {f.path.removeprefix("minisgl/") for f in ch.files if f.path.startswith("minisgl/")}
    base = book.root / "python" / "minisgl"
    live = {
        p.relative_to(base).as_posix()
        for p in (base.rglob("*") if base.is_dir() else [])
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }
    if not tree:
        extra = sorted(live - {"__init__.py"})
        return problems + [
            f"python/minisgl/{p} exists but tree {ch.number} has no minisgl/" for p in extra
        ]
    problems += [
        f"python/minisgl/{p} is not in tree {ch.number} (newest); add minisgl/{p} to `new` in "
        f"chapters/{ch.folder.name}/chapter.toml or delete it"
        for p in sorted(live - tree)
    ]
    problems += [
        f"tree {ch.number} (newest) holds minisgl/{p} but python/minisgl/{p} is missing"
        for p in sorted(tree - live)
    ]
    return problems


def check_page(book: Book, ch: Chapter, run: bool = True) -> list[str]:
    """Property 5: the tree block equals `steps.py tree N`; python blocks are includes;
    count markers hold their tree's numbers (`cases` ones only when `run`: they need pytest)."""
    try:
        lines = pages.read_lines(book, ch.page)
    except StepsError as exc:
        return [str(exc)]
    problems = []
    try:
        begin, end = pages.find_tree_block(lines)
        body, want = [x.rstrip() for x in lines[begin + 1 : end]], pages.tree_block(book, ch)
        if body != want:
            diff = list(difflib.unified_diff(body, want, "page", "manifest", lineterm=""))
            problems.append(
                f"{ch.page}: the tree block differs from `steps.py tree {ch.number}`; "
                f"run `steps.py pages {ch.number}`\n" + "\n".join(diff[2:22])
            )
    except StepsError as exc:
        problems.append(f"{ch.page}: {exc}")
    filled, bad = pages.fill_counts(book, lines, run)
    problems += [f"{ch.page}: {x}" for x in bad]
    for i, (line, fresh) in enumerate(zip(lines, filled)):
        if line != fresh:
            problems.append(f"{ch.page}:{i + 1}: a count marker is stale (the tree says: "
                            f"{fresh.strip()[:160]}); run `steps.py pages {ch.number}`")
    for fence in pages.find_fences(lines):
        where = f"{ch.page}:{fence.start + 1}"
        if fence.end == len(lines):
            problems.append(f"{where}: this fenced block is never closed")
        body = lines[fence.start + 1 : fence.end]
        code = [x for x in body if x.strip()]
        above = next((x.strip() for x in reversed(lines[: fence.start]) if x.strip()), "")
        if fence.is_python and not (code and all(map(pages.INCLUDE_RE.match, code))):
            if above != pages.ILLUSTRATION:
                problems.append(
                    f"{where}: python block pasted, not included: use only "
                    f'`--8<-- "{ch.number}:path#name"` lines, or put {pages.ILLUSTRATION} above it'
                )
        for k, line in enumerate(body):
            if m := pages.INCLUDE_RE.match(line):
                try:
                    pages.resolve_include(book, m[2], ch.number)
                except StepsError as exc:
                    problems.append(f"{ch.page}:{fence.start + k + 2}: {exc}")
    return problems


def check_recorded(book: Book, ch: Chapter) -> list[str]:
    """Property 8: tree N's digest equals the recorded one; an early path differs from its
    successor (chapter N's delta has hunks for it, or stores it whole)."""
    problems = []
    try:
        digest = book.digest(ch)
    except StepsError:
        digest = None  # reported by property 1
    if ch.digest is None:
        problems.append(
            f"chapters/{ch.folder.name}/chapter.toml records no digest: run "
            f"`steps.py record {ch.number}`"
        )
    elif digest is not None and digest != ch.digest:
        problems.append(
            f"tree {ch.number} changed: if chapter {ch.number} meant it, run `steps.py record "
            f"{ch.number}`; if a later edit leaked in (a later tree or the live code changed "
            f"without `steps.py record`, so chapter {ch.number}'s delta.patch is stale), run "
            f"`steps.py record`"
        )
    try:
        sections = book.delta(ch)
    except StepsError:
        sections = {}  # reported by property 1
    for p in ch.early:
        section = sections.get(p)
        if section is None or not (section.hunks or section.new_label == DEV_NULL):
            problems.append(
                f"{p}: early, but tree {ch.number}'s copy equals its successor's "
                f"({book.rel(ch.patch)} has no hunk for it)"
            )
    return problems


def check_used(ch: Chapter, box: Path) -> list[str]:
    """Property 7: every file was imported or opened; a non-.py file may also be named by one."""
    log = box / ".steps" / "imports.log"
    used = set(log.read_text(encoding="utf-8").split()) if log.is_file() else set()
    used.add("main.py")
    texts = "\n".join((box / p).read_text("utf-8", "replace") for p in used if (box / p).is_file())
    return [
        f"tree {ch.number} holds {f.path} but neither main.py nor the tests import it: "
        f"remove it from the tree or use it"
        for f in ch.files
        if f.path not in used and (f.path.endswith(".py") or f.path.rsplit("/", 1)[-1] not in texts)
    ]


def check_chapter(
    book: Book, ch: Chapter, blocks: list[Block], run: bool, timeout: float
) -> dict[int, Verdict]:
    """The verdict on each of the eight properties for chapter N."""
    verdicts: dict[int, Verdict] = {}

    def verdict(n: int, problems: list[str], note: str = "") -> None:
        verdicts[n] = ("FAIL", problems) if problems else ("ok", [note] if note else [])

    missing = book.delta_problems(ch)
    for f in ch.files:
        try:
            book.content(ch, f)
        except StepsError as exc:
            missing.append(str(exc))
    verdict(1, missing)
    verdicts[4] = ("n/a", ["only the newest chapter"])
    if ch is book.chapters[-1]:
        verdict(4, check_python_tree(book))
    verdict(8, check_recorded(book, ch))
    mutants = check_mutants(book, ch)
    static = check_blocks(book, ch, blocks)
    if not run or missing:
        why = "--no-run" if not run else "the tree does not materialise"
        verdicts.update({n: ("skipped", [why]) for n in (2, 3, 7)})
        if mutants:
            verdict(3, mutants)
        verdict(5, check_page(book, ch, False))
        verdict(6, static, f"benchmarks and ids only, {why}")
        return verdicts
    with sandbox(book, ch) as box, Runner(book, ch, timeout, box) as runner:
        main = RunResult(1, "", f"tree {ch.number} has no main.py")
        if ch.file("main.py") is not None:
            main = run_command(book, ["python", "main.py"], box, timeout, isolated=True)
        runner.cache[("tree", ("python", "main.py"))] = main
        main_failure = main.failure("main.py", timeout)
        verdict(2, [main_failure] if main_failure else [])
        tests_failure, note = None, "no tests in the tree"
        if any(f.path.startswith("tests/") for f in ch.files):
            junit = box / ".steps" / "junit.xml"
            cmd = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests",
                   f"--junitxml={junit}"]
            tests = run_command(book, cmd, box, timeout, isolated=True)
            tests_failure = tests.failure("pytest", timeout)
            note = (normalise(tests.stdout) or [""])[-1]
            if not tests_failure and junit.is_file():
                pages.note_test_run(book, ch.number, junit)
        verdict(3, mutants + ([tests_failure] if tests_failure else []), note)
        verdict(5, check_page(book, ch, True))
        if main_failure or tests_failure:
            verdicts[7] = ("skipped", ["main or tests failed"])
        else:
            verdict(7, check_used(ch, box))
        verdict(6, static + compare_blocks(book, ch, blocks, runner, main))
    return verdicts


def page_report(book: Book, blocks: list[Block]) -> tuple[list[str], int, int]:
    """(one line per page: its size, a warning above PAGE_WARNING_KB, markers that name no
    chapter; the number of warnings; the number of failures)."""
    numbers = {c.number for c in book.chapters}
    lines, warnings, failures = [], 0, 0
    width = max((len(p) for p in book.pages()), default=0)
    for page in book.pages():
        kb = (book.root / page).stat().st_size / 1024
        line = f"  {page:<{width}} {kb:5.1f} KB"
        if kb > PAGE_WARNING_KB:
            warnings += 1
            line += f"  warning: over {PAGE_WARNING_KB} KB"
        lines.append(line)
        for b in (b for b in blocks if b.page == page and b.chapter not in numbers):
            failures += 1
            why = f"there is no chapter {b.chapter}" if b.chapter is not None else "write N:ID"
            lines.append(f"    FAIL: {b.where}: output {b.id!r} names no chapter ({why})")
    return lines, warnings, failures


def check(book: Book, numbers: list[int], run: bool, timeout: float, jobs: int = 1) -> int:
    """`steps.py check [N ...]`: print every verdict, the pages' sizes and a summary. With
    `jobs` > 1 that many chapters are checked at once (newest, the slowest, first), and each
    chapter's verdicts are printed when it is done."""
    chapters = [book.get(n) for n in numbers] if numbers else book.chapters
    if not chapters:
        print(f"no chapters: no chapters/chNN_slug/chapter.toml under {book.root}")
    counts = {"ok": 0, "FAIL": 0, "skipped": 0, "n/a": 0}
    blocks = find_blocks(book)

    def timed(ch: Chapter) -> tuple[dict[int, Verdict], float]:
        began = time.perf_counter()
        return check_chapter(book, ch, blocks, run, timeout), time.perf_counter() - began

    def header(ch: Chapter) -> None:
        print(f"chapter {ch.number} ({ch.folder.name}): {ch.title}", flush=True)

    def report(ch: Chapter, verdicts: dict[int, Verdict], seconds: float) -> None:
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
        print(f"  checked in {seconds:.0f} s", flush=True)

    if jobs <= 1:
        for ch in chapters:
            header(ch)
            report(ch, *timed(ch))
    else:
        # several chapters' torch thread pools share the cores: waiting threads should sleep
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # the work is in subprocesses
            futures = {pool.submit(timed, ch): ch for ch in reversed(chapters)}
            for future in as_completed(futures):
                header(futures[future])
                report(futures[future], *future.result())
    lines, warnings, page_failures = page_report(book, blocks)
    index_problems = check_index(book)
    page_failures += len(index_problems)
    for problem in index_problems:
        lines.append("    FAIL: " + problem.replace("\n", "\n        "))
    if (book.root / INDEX_PAGE).is_file() and not index_problems:
        lines.append(f"  {INDEX_PAGE}: the package index matches the trees")
    print(f"pages (a warning above {PAGE_WARNING_KB} KB):", *lines, sep="\n")
    failed = counts["FAIL"] + page_failures
    tail = f", {warnings} warning{'s' * (warnings != 1)}" if warnings else ""
    print(f"summary: {counts['ok']} ok, {failed} failed, {counts['skipped']} skipped{tail}")
    return 1 if failed else 0
