"""Mutation experiments: break tree N on purpose and see which tests notice (chapter 0).

`chapters/chNN_slug/mutants.toml` lists them, one `[[mutant]]` table each: `name`, `about`,
`file` (a path in tree N), `find` (text occurring exactly once in the file's chapter-N content),
`replace`, optional `tests` (default: all of chapter N's tests) and optional `expect` ("killed",
the default, when some test must fail; "survives" when none does).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field

from book.manifest import Book, Chapter, StepsError, checked_table, read_toml
from book.sandbox import run_command, sandbox

MUTANT_KEYS = {
    "name": str,
    "about": str,
    "file": str,
    "find": str,
    "replace": str,
    "tests": list,
    "expect": str,
}


@dataclass
class Mutant:
    name: str
    about: str
    file: str
    find: str
    replace: str
    tests: list[str] = field(default_factory=list)
    expect: str = "killed"


def mutants_file(ch: Chapter) -> str:
    return f"chapters/{ch.folder.name}/mutants.toml"


def load_mutants(ch: Chapter) -> list[Mutant]:
    """Chapter N's mutants, checked for form (not against the tree); [] without a file."""
    where = mutants_file(ch)
    if not (ch.folder / "mutants.toml").is_file():
        return []
    top = checked_table(
        read_toml(ch.folder / "mutants.toml", where), {"mutant": list}, set(), where
    )
    mutants: list[Mutant] = []
    for i, table in enumerate(top["mutant"]):
        at = f"{where}: [[mutant]] #{i + 1}"
        m = Mutant(**checked_table(table, MUTANT_KEYS, {"tests", "expect"}, at))
        if not re.fullmatch(r"[a-z0-9-]+", m.name):
            raise StepsError(f"{at}: a name is made of a-z, 0-9 and '-', not {m.name!r}")
        if any(other.name == m.name for other in mutants):
            raise StepsError(f"{at}: the name {m.name!r} is used twice")
        if not all(isinstance(t, str) for t in m.tests):
            raise StepsError(f"{at}: tests must be a list of strings (pytest ids)")
        if m.expect not in ("killed", "survives"):
            raise StepsError(f"{at}: expect must be 'killed' or 'survives'")
        mutants.append(m)
    return mutants


def mutated(book: Book, ch: Chapter, m: Mutant) -> tuple[str, str]:
    """(chapter-N content of the mutant's file, the same with the edit applied)."""
    f = ch.file(m.file)
    if f is None:
        raise StepsError(f"mutant {m.name}: tree {ch.number} has no {m.file}")
    text = book.content(ch, f).decode("utf-8")
    count = text.count(m.find)
    if count != 1:
        raise StepsError(
            f"mutant {m.name}: `find` occurs {count} times in {m.file} at chapter {ch.number}, "
            f"not once: {m.find[:60]!r}"
        )
    return text, text.replace(m.find, m.replace)


def check_mutants(book: Book, ch: Chapter) -> list[str]:
    """The static part: mutants.toml is well-formed, every edit applies to tree N once, every
    test it names is a test file of tree N."""
    try:
        mutants = load_mutants(ch)
    except StepsError as exc:
        return [str(exc)]
    problems = []
    for m in mutants:
        try:
            mutated(book, ch, m)
        except (StepsError, UnicodeDecodeError) as exc:
            problems.append(f"{mutants_file(ch)}: {exc}")
        for test in m.tests:
            if ch.file(test.split("::")[0]) is None:
                problems.append(
                    f"{mutants_file(ch)}: mutant {m.name}: tree {ch.number} has no {test}"
                )
    return problems


def mutate(book: Book, number: int, name: str | None, timeout: float) -> int:
    """`steps.py mutate N [NAME]`: list chapter N's mutants, or run one and report."""
    ch = book.get(number)
    mutants = {m.name: m for m in load_mutants(ch)}
    if name is None:
        for m in mutants.values():
            print(f"{m.name:<24} {m.about}")
        if not mutants:
            print(f"chapter {number} has no mutants ({mutants_file(ch)})")
        return 0
    if name not in mutants:
        raise StepsError(
            f"chapter {number} has no mutant {name!r} (see `steps.py mutate {number}`)"
        )
    m = mutants[name]
    old, new = mutated(book, ch, m)
    print(f"mutant {m.name} (chapter {number}): {m.about}\nfile: {m.file}")
    names = (f"a/{m.file}", f"b/{m.file}")
    print(*difflib.unified_diff(old.splitlines(), new.splitlines(), *names, lineterm=""), sep="\n")
    print("tests: " + (" ".join(m.tests) or f"all of chapter {number}'s"))
    with sandbox(book, ch) as box:
        (box / m.file).write_text(new, encoding="utf-8")
        # A short summary line per failed test, cut by pytest to the same width everywhere.
        cmd = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=no"]
        cmd += ["--force-short-summary", *(m.tests or ["tests"])]
        result = run_command(
            book, cmd, box, timeout, isolated=True, log="mutant.log", env={"COLUMNS": "120"}
        )
    out = result.stdout.replace(os.path.realpath(box), "<tree>").replace(str(box), "<tree>")
    lines = [x.rstrip() for x in out.splitlines() if x.strip()]
    for line in sorted(x for x in lines if x.startswith(("FAILED ", "ERROR "))):
        print(line)
    if result.returncode is None:
        print(f"the tests timed out after {timeout:g} s")
    elif lines:  # pytest -q ends with its summary, e.g. "3 failed, 12 passed in 4.21s"
        print(re.sub(r" in [\d.]+s\b.*$", "", lines[-1].strip("= ")))
    if result.returncode not in (None, 0, 1, 2):  # 3-5: pytest could not run the tests at all
        raise StepsError(f"pytest exited with {result.returncode}:\n{result.stdout}{result.stderr}")
    outcome = "survives" if result.returncode == 0 else "killed"
    if outcome == m.expect:
        print(f"{'killed' if outcome == 'killed' else 'survived'}, as expected")
        return 0
    if outcome == "survives":
        print(f"the mutant survived: no test failed, but expect = {m.expect!r}")
    else:
        print(f"the mutant was killed unexpectedly (expect = {m.expect!r})")
    return 1
