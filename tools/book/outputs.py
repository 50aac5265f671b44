"""The "运行结果" blocks of the pages: running, masking, comparing, regenerating (chapter 0).

A block is a marker `<!-- output: ID -->` followed by a ```text fence. On chapter N's page ID
names one of chapter N's outputs; on any page `N:ID` does. An output is an entry of the
`output` list of chapter.toml, or `mutant:NAME`, the report of `steps.py mutate N NAME`. An
output with `results` is a benchmark: its block shows the committed results file, which
`steps.py bench N ID` writes; checks only run it with `--quick`, to see that it still works.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from book.manifest import Book, Chapter, Output, StepsError
from book.mutate import load_mutants
from book.pages import (
    Fence,
    fill_counts,
    find_output_markers,
    find_tree_block,
    read_lines,
    tree_block,
)
from book.sandbox import RunResult, run_command, sandbox

STEPS = Path(__file__).resolve().parents[1] / "steps.py"
MASK_LINE = "# mask-line"
UNITS = "tokens/s|tok/s|it/s|毫秒|秒|sec|min|ms|µs|μs|us|s|KiB|MiB|GiB|KB|MB|GB|B|x|倍"
NUMBER_RE = r"(?<![A-Za-z0-9_.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
QUANTITY_RE = re.compile(rf"{NUMBER_RE}[ \t]*({UNITS})(?![A-Za-z0-9_/])")
DATE_RE = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
    r"|(?<!\d)\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
)
QUICK_TIMEOUT = 300.0  # seconds for a benchmark's --quick smoke run


def mask(text: str) -> str:
    """Hide what changes from run to run: dates, times, durations, rates and sizes."""
    text = DATE_RE.sub("<date>", text)
    return QUANTITY_RE.sub(lambda m: f"<N {m[1]}>", text)


def normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def outputs_match(expected: str, actual: str) -> bool:
    """Equal after masking; a line marked `# mask-line` only up to its first digit."""
    exp, act = normalise(mask(expected)), normalise(mask(actual))
    before_digit = lambda line: re.split(r"\d", line, maxsplit=1)[0]
    return len(exp) == len(act) and all(
        a == b or ((MASK_LINE in a or MASK_LINE in b) and before_digit(a) == before_digit(b))
        for a, b in zip(exp, act)
    )


def diff_lines(old: str, new: str, names: tuple[str, str]) -> str:
    diff = difflib.unified_diff(normalise(mask(old)), normalise(mask(new)), *names, lineterm="")
    return "\n".join(list(diff)[2:32])


# ---------------------------------------------------------------------------- blocks and outputs


@dataclass
class Block:
    page: str
    line: int  # index of the marker line
    chapter: int | None  # None: the marker names no chapter (a bare id outside chapter pages)
    id: str
    fence: Fence | None  # the ```text fence after the marker
    body: list[str]  # the lines inside that fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line + 1}"

    @property
    def text(self) -> str:
        return "\n".join(self.body)


def find_blocks(book: Book) -> list[Block]:
    """Every output block of every page under docs/."""
    blocks = []
    for page in book.pages():
        owner = book.chapter_of_page(page)
        lines = read_lines(book, page)
        for spec, i, fence in find_output_markers(lines):
            m = re.fullmatch(r"(\d+):(.+)", spec)
            number = int(m[1]) if m else owner.number if owner else None
            body = lines[fence.start + 1 : fence.end] if fence else []
            blocks.append(Block(page, i, number, m[2] if m else spec, fence, body))
    return blocks


def chapter_outputs(book: Book, ch: Chapter) -> dict[str, Output]:
    """Chapter N's outputs by id: its [[output]] entries and `mutant:NAME` for each mutant."""
    outputs = {o.id: o for o in ch.outputs}
    with contextlib.suppress(StepsError):  # a broken mutants.toml is reported by property 3
        for m in load_mutants(ch):
            cmd = ["python", str(STEPS), "--root", str(book.root), "mutate", str(ch.number), m.name]
            outputs[f"mutant:{m.name}"] = Output(f"mutant:{m.name}", cmd, "repo")
    return outputs


def results_text(book: Book, ch: Chapter, out: Output) -> str:
    """A benchmark's recorded output: its results file less the header line."""
    assert out.results is not None
    path = book.root / out.results
    if not path.is_file():
        raise StepsError(f"{out.results} is missing: run `steps.py bench {ch.number} {out.id}`")
    header, _, text = path.read_text(encoding="utf-8").partition("\n")
    if not header.startswith("# "):
        raise StepsError(f"{out.results} must start with a '# ' line naming machine and date")
    return text


class Runner:
    """Runs a chapter's outputs, each distinct command once, a sandbox made when first needed."""

    def __init__(self, book: Book, ch: Chapter, timeout: float, box: Path | None = None) -> None:
        self.book, self.ch, self.timeout, self.box = book, ch, timeout, box
        self.cache: dict[tuple, RunResult] = {}
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def run(self, out: Output, quick: bool = False) -> RunResult:
        cmd = [*out.cmd, "--quick"] if quick else out.cmd
        key = (out.where, tuple(cmd))
        if key not in self.cache:
            if out.where == "tree" and self.box is None:
                self.box = self.stack.enter_context(sandbox(self.book, self.ch))
            cwd = self.box if out.where == "tree" else self.book.root
            assert cwd is not None
            timeout = min(self.timeout, QUICK_TIMEOUT) if quick else self.timeout
            self.cache[key] = run_command(
                self.book, cmd, cwd, timeout, isolated=out.where == "tree", log="outputs.log"
            )
        return self.cache[key]


# ---------------------------------------------------------------------------- property 6


def check_blocks(book: Book, ch: Chapter, blocks: list[Block]) -> list[str]:
    """The static half of property 6: markers name known outputs and are followed by a text
    block, every [[output]] is shown somewhere, benchmark blocks equal their results file."""
    outputs, problems = chapter_outputs(book, ch), []
    mine = [b for b in blocks if b.chapter == ch.number]
    for b in mine:
        out = outputs.get(b.id)
        if out is None:
            problems.append(f"{b.where}: chapter {ch.number} has no output {b.id!r}")
        elif b.fence is None:
            problems.append(
                f"{b.where}: <!-- output: ... --> must be followed by a ```text block "
                f"(run `steps.py pages {ch.number}`)"
            )
        elif out.results is not None:
            try:
                recorded = results_text(book, ch, out)
            except StepsError as exc:
                problems.append(f"{b.where}: {exc}")
                continue
            if not outputs_match(b.text, recorded):
                problems.append(
                    f"{b.where}: output {b.id!r} differs from {out.results} (masked); run "
                    f"`steps.py pages {ch.number}`\n"
                    + diff_lines(b.text, recorded, ("page", out.results))
                )
    used = {b.id for b in mine}
    problems += [
        f"chapter {ch.number}'s [[output]] {o.id!r} is not shown on any page "
        f"(add <!-- output: {o.id} --> to {ch.page})"
        for o in ch.outputs
        if o.id not in used
    ]
    return problems


def compare_blocks(
    book: Book, ch: Chapter, blocks: list[Block], runner: Runner, main: RunResult | None
) -> list[str]:
    """The running half of property 6: every block matches a fresh run (masked); a benchmark
    runs with --quick and must only succeed."""
    outputs, problems = chapter_outputs(book, ch), []
    for b in blocks:
        out = outputs.get(b.id)
        if b.chapter != ch.number or out is None or b.fence is None:
            continue  # not this chapter's, or reported by check_blocks
        result = runner.run(out, quick=out.results is not None)
        what = f"output {b.id!r}" + (" --quick" if out.results else "")
        if result is main and main.returncode != 0:
            problems.append(f"{b.where}: output {b.id!r} is main.py's, which fails (see [2])")
        elif (failure := result.failure(what, runner.timeout)) is not None:
            problems.append(f"{b.where}: {failure}")
        elif out.results is None and not outputs_match(b.text, result.stdout):
            problems.append(
                f"{b.where}: output {b.id!r} no longer matches a fresh run (masked); run "
                f"`steps.py pages {ch.number}` if the new output is right\n"
                + diff_lines(b.text, result.stdout, ("page", "fresh run"))
            )
    return problems


# ---------------------------------------------------------------------------- pages, bench


def fresh_block(book: Book, ch: Chapter, b: Block, runner: Runner, force: bool) -> list[str]:
    """The lines block `b` should hold: the results file of a benchmark, else a fresh run (the
    old lines when they still match it, unless `force`); StepsError when that fails."""
    out = chapter_outputs(book, ch).get(b.id)
    if out is None:
        raise StepsError(f"{b.where}: chapter {ch.number} has no output {b.id!r}")
    if out.results is not None:
        return normalise(results_text(book, ch, out))
    result = runner.run(out)
    if (failure := result.failure(f"output {b.id!r}", runner.timeout)) is not None:
        raise StepsError(f"{b.where}: {failure}")
    if b.fence and not force and outputs_match(b.text, result.stdout):
        return b.body
    lines = normalise(result.stdout)
    for k, line in enumerate(b.body[: len(lines)]):  # keep the mask-line marks
        if MASK_LINE in line and MASK_LINE not in lines[k]:
            lines[k] += f"  {MASK_LINE}"
    return lines


def regenerate(book: Book, chapters: list[Chapter], timeout: float, force: bool) -> bool:
    """`steps.py pages`: rewrite each chapter's tree block and its output blocks, on whatever
    page they sit, and the count markers of its page; False when some output or count could
    not be made."""
    edits: dict[str, list[tuple[int, int, list[str]]]] = {}  # page -> replace lines[a:b]
    blocks, ok = find_blocks(book), True
    for ch in chapters:
        try:
            begin, end = find_tree_block(read_lines(book, ch.page))
        except StepsError as exc:
            raise StepsError(f"{ch.page}: {exc}") from None
        edits.setdefault(ch.page, []).append((begin + 1, end, tree_block(book, ch)))
        with Runner(book, ch, timeout) as runner:
            for b in (b for b in blocks if b.chapter == ch.number):
                try:
                    lines = fresh_block(book, ch, b, runner, force)
                except StepsError as exc:
                    print(exc, file=sys.stderr)
                    ok = False
                    continue
                if b.fence is None:  # a bare marker: add the fence after it
                    edit = (b.line + 1, b.line + 1, ["```text", *lines, "```"])
                else:
                    edit = (b.fence.start + 1, b.fence.end, lines)
                edits.setdefault(b.page, []).append(edit)
    for page, changes in edits.items():
        lines = read_lines(book, page)
        for start, stop, new in sorted(changes, reverse=True):
            lines[start:stop] = new
        if page in {ch.page for ch in chapters}:
            lines, bad = fill_counts(book, lines)
            for problem in bad:
                print(f"{page}: {problem}", file=sys.stderr)
                ok = False
        (book.root / page).write_text("\n".join(lines), encoding="utf-8")
    return ok


def machine() -> str:
    """The CPU model (from /proc/cpuinfo, else platform.processor()) and the CPU count."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.partition(":")[0].strip() == "model name":
                model = line.partition(":")[2].strip()
                break
    return f"{model}, {os.cpu_count()} logical CPUs"


def bench(book: Book, number: int, oid: str, timeout: float) -> int:
    """`steps.py bench N ID`: run benchmark ID in full and write its results file."""
    ch = book.get(number)
    out = ch.output(oid)
    if out is None or out.results is None:
        raise StepsError(f"chapter {number} has no [[output]] {oid!r} with a `results` file")
    print(f"running {' '.join(out.cmd)} (a benchmark: this takes a while)", flush=True)
    with Runner(book, ch, timeout) as runner:
        result = runner.run(out)
    if (failure := result.failure(f"output {oid!r}", timeout)) is not None:
        print(failure, file=sys.stderr)
        return 1
    header = f"# {' '.join(out.cmd)} · {machine()} · {datetime.date.today()}"
    (book.root / out.results).parent.mkdir(parents=True, exist_ok=True)
    (book.root / out.results).write_text(f"{header}\n{result.stdout}", encoding="utf-8")
    print(f"wrote {out.results}; now run `steps.py pages {number}` to show it")
    return 0
