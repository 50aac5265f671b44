"""Reverse deltas: a chapter's tree stored as tree N's lines that differ from its successor tree.

A chapter's `delta.patch` holds one section per file of tree N whose content differs from its
successor. Each section runs from tree N (`--- treeNN/<path>`) to the successor
(`+++ treeMM/<path>`, `+++ repo/<live path>` or `+++ /dev/null`). It is written in unified-diff
syntax with zero context, but stores only tree N's side: a hunk is its header
`@@ -a,b +c,d @@` and tree N's `b` lines, each as a `-` line. The successor's lines are not
repeated (the tool reads them from the successor itself), and there are no context lines. Tree
N's file is rebuilt from its successor's text by replacing, hunk by hunk, the successor's lines
[c, c+d) by the hunk's `-` lines, strictly: the ranges must come in order, lie inside the
successor and not overlap. There is no fuzz and no offset search.

Nothing in a hunk checks the successor's content, so a successor that changed without its
delta being re-derived gives a wrong tree N unless its ranges no longer fit; that is caught by
tree N's recorded digest (`steps.py check`, property 8).

A file that tree MM holds at another path (it moved) may be stored as a rename, the way git
writes one: the section opens with `rename from <path>` and `rename to <new path>`, its `+++`
label is `treeMM/<new path>`, and its hunks (none when the file moved unchanged) run from tree
N's text to that file's.

Texts are `str` split on "\\n" only, so "\\r", form feeds and a missing final newline
(`\\ No newline at end of file` after tree N's last line) survive byte for byte. A patch must
therefore be read and written without newline translation: use `read_patch`, and write the
text from `encode_delta` as UTF-8 bytes.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEV_NULL = "/dev/null"
NO_NEWLINE = "\\ No newline at end of file"
RECORD_HINT = "run `steps.py record`"

_NUM = "(0|[1-9][0-9]*)"
_HUNK_RE = re.compile(rf"@@ -{_NUM}(?:,{_NUM})? \+{_NUM}(?:,{_NUM})? @@")
_OLD_LABEL_RE = re.compile(r"tree([0-9]+)/(.+)")
RENAME_FROM = "rename from "
RENAME_TO = "rename to "


class DeltaError(Exception):
    """A delta that is malformed, or that does not fit the text it is applied to."""


@dataclass(frozen=True)
class Hunk:
    """One hunk: its header as written, its two ranges and tree N's lines.

    A range's start is 1-based, or names the line before the range when its length is 0.
    `lines` are tree N's `old_len` lines that take the place of the successor's `new_len`
    lines; a line keeps its "\\n" unless it is the last line of a file that has none. `legacy`:
    the hunk was written in the older form, with `+` and context lines (see `parse_delta`).
    """

    header: str
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[str, ...]


@dataclass(frozen=True)
class FileDelta:
    """One file's section of a patch: its path in tree N, both labels and its hunks; `rename`
    is the successor's path when the section is a rename (`rename from` / `rename to`)."""

    path: str
    old_label: str
    new_label: str
    hunks: tuple[Hunk, ...]
    rename: str | None = None


# ---------------------------------------------------------------------------- text


def tree_label(n: int, path: str) -> str:
    """The label of `path` in tree `n`, as a section header writes it: `treeNN/<path>`."""
    return f"tree{n:02d}/{path}"


def renamed_to(path: str, label: str) -> str | None:
    """The path a `+++` label names when it is a tree label of a path other than `path` (the
    section is then a rename), else None."""
    match = _OLD_LABEL_RE.fullmatch(label)
    return match.group(2) if match is not None and match.group(2) != path else None


def decode_text(data: bytes, where: str) -> str:
    """`data` as UTF-8 text; DeltaError naming `where` when it is not (a delta needs text)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DeltaError(f"{where}: not UTF-8 text ({exc}); a delta needs text") from None


def split_lines(text: str) -> list[str]:
    """The lines of `text`, each with its "\\n" (the last may lack it); splits on "\\n" only."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


# ---------------------------------------------------------------------------- writing


def encode_delta(n: int, files: Mapping[str, tuple[str, str, str]]) -> str:
    """The patch text of chapter `n` from {path: (tree N text, successor text, `+++` label)}.

    Sections come in path order. A file equal to its successor gets no section, except when
    the label is /dev/null (the successor text must then be empty): that section holds the
    whole file, and no hunks at all when the file is empty; or when the label is a tree label
    of another path: that section is a rename, and has no hunks when the texts are equal.

    Each run of lines that differ is one hunk: its header, with both ranges, and tree N's lines
    of the run as `-` lines (none where only the successor has lines there). The successor's
    lines are not written, nor any context.
    """
    out: list[str] = []
    targets: set[str] = set()
    for path in sorted(files):
        old, new, label = files[path]
        if not path or "\n" in path or not label or "\n" in label:
            raise ValueError(f"bad path or label: {path!r} -> {label!r}")
        if label == DEV_NULL and new:
            raise ValueError(f"{path}: the successor is {DEV_NULL} but its text is not empty")
        target = renamed_to(path, label)
        if target is not None:
            if target in targets:
                raise ValueError(f"{path}: a second rename to {target}")
            targets.add(target)
            out += [f"{RENAME_FROM}{path}\n", f"{RENAME_TO}{target}\n"]
        elif old == new and label != DEV_NULL:
            continue
        out += [f"--- {tree_label(n, path)}\n", f"+++ {label}\n"]
        out += _encode_hunks(split_lines(old), split_lines(new))
    return "".join(out)


def section_length(path: str, old: str, new: str, label: str) -> int:
    """How many lines `encode_delta` writes for this one file (0 when it writes no section)."""
    return encode_delta(0, {path: (old, new, label)}).count("\n")


def find_renames(
    gone: Mapping[str, tuple[str, str, str]], added: Mapping[str, str], n: int
) -> dict[str, str]:
    """{old path: new path}: the files of tree N that tree `n` (its successor) lacks, paired
    with files new in tree `n`, where storing the file as a rename is shorter.

    `gone` is {path: (tree N text, successor text, `+++` label)} as `encode_delta` takes it
    without a rename (the live copy, or /dev/null); `added` is {path: text} of the paths tree
    `n` holds and tree N does not. A pair counts only when its rename section has fewer lines
    than the section the file gets otherwise. The pairs that save the most lines are taken
    first, ties in path order, and each path is used once, so the result is deterministic.
    """
    candidates = []
    for path, (old, new, label) in gone.items():
        plain = section_length(path, old, new, label)
        if plain <= 4:  # a rename section has 4 header lines at least
            continue
        for target, text in added.items():
            if target == path:
                continue
            moved = section_length(path, old, text, tree_label(n, target))
            if moved < plain:
                candidates.append((moved - plain, path, target))
    pairs: dict[str, str] = {}
    used: set[str] = set()
    for _, path, target in sorted(candidates):
        if path not in pairs and target not in used:
            pairs[path] = target
            used.add(target)
    return pairs


def _encode_hunks(old: list[str], new: list[str]) -> list[str]:
    """The hunks from `old` to `new`, as patch lines each ending in "\\n": one per run of
    lines that differ, holding only the lines of `old`."""
    out: list[str] = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            out.append(f"@@ -{_format_range(i1, i2)} +{_format_range(j1, j2)} @@\n")
            out += _body_lines(old[i1:i2])
    return out


def _format_range(start: int, stop: int) -> str:
    """A hunk range for the 0-based lines [start, stop), as GNU diff writes it."""
    length = stop - start
    first = start + 1 if length else start
    return f"{first}" if length == 1 else f"{first},{length}"


def _body_lines(lines: list[str]) -> list[str]:
    """`-` lines for `lines`, with the marker after a line that has no "\\n"."""
    out = []
    for line in lines:
        if line.endswith("\n"):
            out.append("-" + line)
        else:
            out += ["-" + line + "\n", NO_NEWLINE + "\n"]
    return out


# ---------------------------------------------------------------------------- reading


def read_patch(file: Path, name: str | None = None) -> dict[str, FileDelta]:
    """Parse the patch in `file`, read as bytes so that no newline is translated."""
    where = name if name is not None else str(file)
    return parse_delta(decode_text(file.read_bytes(), where), where)


def parse_delta(text: str, patch: str) -> dict[str, FileDelta]:
    """Parse patch text into {path: FileDelta}, in the order of the patch.

    Strict: garbage lines, a bad or misnumbered hunk header, a body whose line counts differ
    from its header, a repeated path, a mix of trees, a `+++` label naming another path without
    `rename from` / `rename to` lines (or disagreeing with them) or two renames to one path raise
    DeltaError naming `patch`, the line, the file and the hunk. `text` must come without
    newline translation (`read_patch`).
    """
    if text and not text.endswith("\n"):
        raise DeltaError(f"{patch}: the last line has no newline; the patch is cut short")
    lines = text.split("\n")[:-1]
    sections: dict[str, FileDelta] = {}
    targets: dict[str, str] = {}  # rename target -> the path renamed to it
    tree = None
    i = 0
    while i < len(lines):
        rename = rename_line = None
        if lines[i].startswith(RENAME_FROM):
            source, rename_line = lines[i][len(RENAME_FROM) :], i + 1
            to = lines[i + 1] if i + 1 < len(lines) else None
            if to is None or not to.startswith(RENAME_TO) or to == RENAME_TO:
                found = "the end of the patch" if to is None else repr(to)
                raise DeltaError(
                    f"{patch}:{i + 2}: {source}: expected 'rename to <path>' after "
                    f"'rename from', found {found}"
                )
            rename = to[len(RENAME_TO) :]
            i += 2
        if i >= len(lines) or not lines[i].startswith("--- "):
            found = "the end of the patch" if i >= len(lines) else repr(lines[i])
            after = " after 'rename to'" if rename else ""
            raise DeltaError(
                f"{patch}:{i + 1}: expected a '--- treeNN/<path>' line{after}, found {found}"
            )
        old_label = lines[i][4:]
        plus = lines[i + 1] if i + 1 < len(lines) else ""
        match = _OLD_LABEL_RE.fullmatch(old_label)
        if match is None:
            raise DeltaError(f"{patch}:{i + 1}: {old_label!r} is not 'treeNN/<path>'")
        path = match.group(2)
        if tree is not None and match.group(1) != tree:
            raise DeltaError(f"{patch}:{i + 1}: {path}: tree{match.group(1)}, not tree{tree}")
        tree = match.group(1)
        if path in sections:
            raise DeltaError(f"{patch}:{i + 1}: {path} has a second section")
        if not plus.startswith("+++ ") or len(plus) == 4:
            found = repr(plus) if i + 1 < len(lines) else "the end of the patch"
            raise DeltaError(f"{patch}:{i + 2}: {path}: expected '+++ <label>', found {found}")
        target = renamed_to(path, plus[4:])
        if rename is None and target is not None:
            raise DeltaError(
                f"{patch}:{i + 2}: {path}: the '+++' label {plus[4:]} names another path, but "
                f"the section has no 'rename from' / 'rename to' lines"
            )
        if rename is not None:
            if rename == path:
                raise DeltaError(f"{patch}:{rename_line}: {path}: renamed to itself")
            if source != path:
                raise DeltaError(
                    f"{patch}:{rename_line}: 'rename from {source}' opens the section of {path}"
                )
            if target != rename:
                raise DeltaError(
                    f"{patch}:{i + 2}: {path}: 'rename to {rename}' but the '+++' label is "
                    f"{plus[4:]}, not treeNN/{rename}"
                )
            if rename in targets:
                raise DeltaError(
                    f"{patch}:{rename_line}: {path}: renamed to {rename}, which "
                    f"{targets[rename]} is renamed to already"
                )
            targets[rename] = path
        section_line = i + 1
        i += 2
        hunks: list[Hunk] = []
        shift = old_end = 0  # new index minus old index after the hunks so far; end of the last
        ended = False  # a hunk reached the end of a file that has no final newline
        while i < len(lines) and lines[i].startswith("@@"):
            k = len(hunks) + 1
            if ended:
                raise DeltaError(
                    f"{patch}:{i + 1}: {path}: hunk {k} ({lines[i]}) follows the end of the file"
                )
            hunk, i_next, ended = _parse_hunk(lines, i, patch, path, k)
            old_at = _index(hunk.old_start, hunk.old_len)
            new_at = _index(hunk.new_start, hunk.new_len)
            name = f"{patch}:{i + 1}: {path}: hunk {k} ({hunk.header}) is misnumbered"
            if old_at < old_end:
                raise DeltaError(f"{name}: it starts before the end of hunk {k - 1}")
            if new_at - old_at != shift:
                want = old_at + shift + (1 if hunk.new_len else 0)
                raise DeltaError(
                    f"{name}: the hunks before it shift lines by {shift}, so its new range "
                    f"should start at {want}, not {hunk.new_start}"
                )
            shift += hunk.new_len - hunk.old_len
            old_end = old_at + hunk.old_len
            hunks.append(hunk)
            i = i_next
        if i < len(lines) and not lines[i].startswith(("--- ", RENAME_FROM)):
            if hunks and lines[i][:1] in (" ", "-", "+", "\\"):
                raise DeltaError(
                    f"{patch}:{i + 1}: {path}: hunk {len(hunks)} ({hunks[-1].header}) has more "
                    f"lines than its header counts: {lines[i]!r}"
                )
            raise DeltaError(
                f"{patch}:{i + 1}: {path}: expected a hunk header or the next file's '--- ' "
                f"or 'rename from' line, found {lines[i]!r}"
            )
        if not hunks and plus[4:] != DEV_NULL and rename is None:
            raise DeltaError(f"{patch}:{section_line}: {path}: a section without hunks")
        sections[path] = FileDelta(path, old_label, plus[4:], tuple(hunks), rename)
    return sections


def _index(start: int, length: int) -> int:
    """The 0-based index at which a hunk range begins."""
    return start - 1 if length else start


def _parse_hunk(lines: list[str], i: int, patch: str, path: str, k: int) -> tuple[Hunk, int, bool]:
    """The hunk whose header is lines[i] (its header, then `old_len` `-` lines), the index after
    it, and whether it ends a file that has no final newline."""
    header = lines[i]
    match = _HUNK_RE.fullmatch(header)
    if match is None:
        raise DeltaError(f"{patch}:{i + 1}: {path}: hunk {k}: bad hunk header {header!r}")
    old_start, old_len, new_start, new_len = (
        int(g) if g is not None else 1 for g in match.groups()
    )
    name = f"{path}: hunk {k} ({header})"
    if (old_len and not old_start) or (new_len and not new_start) or not (old_len or new_len):
        raise DeltaError(f"{patch}:{i + 1}: {name} is misnumbered")
    body: list[str] = []  # tree N's lines
    ended = False
    i += 1
    while len(body) < old_len:
        line = lines[i] if i < len(lines) else None
        if line is None or line[:1] != "-":
            found = "the end of the patch" if line is None else repr(line)
            raise DeltaError(
                f"{patch}:{i + 1}: {name}: its body has {len(body)} of the {old_len} '-' lines "
                f"its header counts; found {found}"
            )
        if ended:
            raise DeltaError(f"{patch}:{i + 1}: {name}: a line follows the end of the file")
        i += 1
        ended = i < len(lines) and lines[i] == NO_NEWLINE
        i += ended
        body.append(line[1:] if ended else line[1:] + "\n")
    return Hunk(header, old_start, old_len, new_start, new_len, tuple(body)), i, ended


# ---------------------------------------------------------------------------- applying


def check_successor(section: FileDelta, expected: str, patch: str) -> None:
    """Fail unless the section's `+++` label is `expected`, the label the successor rule
    gives now (a path added to or dropped from a later tree changes it)."""
    if section.new_label != expected:
        raise DeltaError(
            f"{patch}: {section.path}: the delta is against {section.new_label} but the "
            f"successor is now {expected}; the trees changed without the delta being "
            f"re-derived ({RECORD_HINT})"
        )


def apply_reverse(
    successor_text: str, hunks: Sequence[Hunk], *, patch: str, path: str, successor: str
) -> str:
    """Tree N's text from its successor's, by applying `hunks` in reverse, strictly.

    Each hunk replaces the successor's lines its `+` range names by its lines (tree N's). The
    ranges must come in order, not overlap and lie inside the successor; a hunk whose last line
    has no final newline must end the successor, and no line may be put after a successor's
    last line that has none. Nothing else is checked: the successor's lines are not stored.
    `patch`, `path` and `successor` (the successor's label) name things in the DeltaError
    raised when a hunk does not fit.
    """
    succ = split_lines(successor_text)
    stale = f"the successor changed without its delta being re-derived ({RECORD_HINT})"
    out: list[str] = []
    pos = 0
    for k, hunk in enumerate(hunks, 1):
        where = f"{patch}: {path}: hunk {k} ({hunk.header})"
        start = _index(hunk.new_start, hunk.new_len)
        end = start + hunk.new_len
        if (
            start < pos
            or _index(hunk.old_start, hunk.old_len) != len(out) + start - pos
            or len(hunk.lines) != hunk.old_len
        ):
            raise DeltaError(f"{where} is misnumbered")
        if end > len(succ):
            if not hunk.new_len:
                span = f"it goes after line {start}"
            elif hunk.new_len == 1:
                span = f"it replaces line {end}"
            else:
                span = f"it replaces lines {start + 1} to {end}"
            raise DeltaError(
                f"{where} does not fit {successor}: {span}, but the successor has "
                f"{len(succ)} line{'s' * (len(succ) != 1)}; {stale}"
            )
        old = hunk.lines
        if old and not old[-1].endswith("\n") and end != len(succ):
            raise DeltaError(
                f"{where} does not fit {successor}: the hunk ends the file, but the successor "
                f"goes on at line {end + 1} with {_show(succ[end])}; {stale}"
            )
        out += succ[pos:start]
        if old and out and not out[-1].endswith("\n"):
            raise DeltaError(
                f"{where} does not fit {successor}: it puts lines after line {start}, the "
                f"successor's last, which has no newline at end of file; {stale}"
            )
        out += old
        pos = end
    out += succ[pos:]
    return "".join(out)


def _show(line: str) -> str:
    """A line for a message: its repr without the "\\n", or a note that it has none."""
    if line.endswith("\n"):
        return repr(line[:-1])
    return f"{line!r} (no newline at end of file)"
