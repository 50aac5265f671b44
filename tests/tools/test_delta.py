"""Unit tests of tools/book/delta.py: writing, reading and strictly applying reverse deltas."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
from book.delta import (  # noqa: E402
    DEV_NULL,
    DeltaError,
    FileDelta,
    Hunk,
    apply_reverse,
    check_successor,
    decode_text,
    encode_delta,
    find_renames,
    parse_delta,
    read_patch,
    section_length,
    split_lines,
    tree_label,
)

PATCH = "chapters/ch03_x/delta.patch"


def lines_text(n: int, tag: str = "line") -> str:
    return "".join(f"{tag} {k}\n" for k in range(1, n + 1))


def section(old: str, new: str, label: str = "tree04/a.py") -> FileDelta:
    """The parsed section for one file changed from `old` (tree 3) to `new`."""
    text = encode_delta(3, {"a.py": (old, new, label)})
    return parse_delta(text, PATCH)["a.py"]


def rebuild(fd: FileDelta, successor_text: str) -> str:
    return apply_reverse(
        successor_text, fd.hunks, patch=PATCH, path=fd.path, successor=fd.new_label
    )


def round_trip(old: str, new: str, label: str = "tree04/a.py") -> str:
    """Encode old -> new, parse it back, apply it in reverse to `new`; return the patch."""
    text = encode_delta(3, {"a.py": (old, new, label)})
    sections = parse_delta(text, PATCH)
    if old == new and label != DEV_NULL:
        assert text == "" and sections == {}
        return text
    fd = sections["a.py"]
    assert (fd.old_label, fd.new_label) == ("tree03/a.py", label)
    assert rebuild(fd, new) == old
    assert only_old_lines(text), text
    return text


def only_old_lines(text: str) -> bool:
    """Whether every line of a section's body is a hunk header, a `-` line or the marker: no
    `+` line (the successor's) and no context line."""
    lines = text.split("\n")[:-1]  # on "\n" only, as the reader splits
    body = [line for line in lines if not line.startswith(("--- ", "+++ ", "rename "))]
    return all(line.startswith(("@@ ", "-", "\\ No newline")) for line in body)


# ---------------------------------------------------------------------------- lines


def test_split_lines_splits_on_newline_only() -> None:
    assert split_lines("") == []
    assert split_lines("a\r\nb\x0cc\rd\ne") == ["a\r\n", "b\x0cc\rd\n", "e"]
    assert split_lines("a\n\n") == ["a\n", "\n"]
    assert "".join(split_lines("x\u2028y\x85z\n")) == "x\u2028y\x85z\n"
    assert len(split_lines("x\u2028y\x85z\n")) == 1


def test_decode_text_refuses_binary() -> None:
    assert decode_text("ü\n".encode(), "f") == "ü\n"
    with pytest.raises(DeltaError, match=r"^blob\.bin: not UTF-8 text"):
        decode_text(b"\xff\xfe\x00", "blob.bin")


def test_tree_label_pads_the_number() -> None:
    assert tree_label(3, "minisgl/a.py") == "tree03/minisgl/a.py"
    assert tree_label(21, "x") == "tree21/x"


# ---------------------------------------------------------------------------- writing


def encode(old: str, new: str, label: str = "tree04/x.py") -> str:
    """The patch text for x.py changed from `old` (tree 3) to `new`, without its two labels."""
    text = encode_delta(3, {"x.py": (old, new, label)})
    head = f"--- tree03/x.py\n+++ {label}\n"
    assert text.startswith(head)
    return text[len(head) :]


def test_encode_writes_the_header_and_tree_n_lines_only() -> None:
    old, new = "a\nb\nc\nd\n", "a\nB\nc\nd\n"
    assert encode_delta(3, {"x.py": (old, new, "repo/x.py")}) == (
        "--- tree03/x.py\n+++ repo/x.py\n@@ -2 +2 @@\n-b\n"  # no "+B", no context
    )
    assert encode("a\n", "b\n") == "@@ -1 +1 @@\n-a\n"
    assert encode("a\nb\n", "a\nB\nB2\n") == "@@ -2 +2,2 @@\n-b\n"
    assert encode("a\nc\n", "a\nb\nc\n") == "@@ -1,0 +2 @@\n"  # only the successor has it
    assert encode("a\nb\nc\n", "a\nc\n") == "@@ -2 +1,0 @@\n-b\n"  # only tree N has it
    assert encode("x\na\n", "a\n") == "@@ -1 +0,0 @@\n-x\n"  # at the top of the file
    # one hunk per run of differing lines, even with one equal line between two runs
    assert encode("1\n2\n3\n4\n5\n", "1\nB\n3\nD\n5\n") == "@@ -2 +2 @@\n-2\n@@ -4 +4 @@\n-4\n"


def test_encode_orders_sections_by_path_and_skips_identical_files() -> None:
    files = {
        "z.py": ("1\n", "2\n", "tree04/z.py"),
        "same.py": ("s\n", "s\n", "tree04/same.py"),
        "a/b.py": ("1\n", "2\n", "repo/a/b.py"),
    }
    text = encode_delta(3, files)
    heads = [line for line in text.splitlines() if line.startswith("--- ")]
    assert heads == ["--- tree03/a/b.py", "--- tree03/z.py"]
    assert list(parse_delta(text, PATCH)) == ["a/b.py", "z.py"]
    assert encode_delta(3, dict(reversed(list(files.items())))) == text


def test_encode_refuses_text_for_dev_null_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="/dev/null"):
        encode_delta(3, {"a.py": ("x\n", "y\n", DEV_NULL)})
    with pytest.raises(ValueError, match="bad path"):
        encode_delta(3, {"a\n.py": ("x\n", "y\n", "tree04/a.py")})


# ---------------------------------------------------------------------------- round trips


def test_identical_files_have_no_section() -> None:
    assert round_trip("a\nb\n", "a\nb\n") == ""
    assert round_trip("", "") == ""
    assert round_trip("no newline", "no newline") == ""


def test_dev_null_successor_holds_the_whole_file() -> None:
    text = round_trip("a\nb\n", "", DEV_NULL)
    assert text == "--- tree03/a.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-a\n-b\n"
    round_trip("only\r", "", DEV_NULL)


def test_empty_file_with_dev_null_successor_is_a_section_without_hunks() -> None:
    text = round_trip("", "", DEV_NULL)
    assert text == "--- tree03/a.py\n+++ /dev/null\n"
    assert parse_delta(text, PATCH)["a.py"].hunks == ()


def test_empty_successor_and_empty_tree_file() -> None:
    round_trip("a\nb\n", "")
    round_trip("", "a\nb\n")


@pytest.mark.parametrize(
    ("old", "new", "marker"),
    [
        ("a\nb\nc", "a\nb\nc\n", True),  # tree N lacks the final newline
        ("a\nb\nc\n", "a\nb\nc", False),  # the successor lacks it: its lines are not stored
        ("a\nb\nc", "a\nB\nc", False),  # both lack it; the last line is in no hunk
        ("a\nb\nc", "a\nb\nd", True),  # both lack it; the last line changes
        ("x", "y", True),
        ("x", "", True),
        ("", "x", False),
        ("a\n" * 5 + "z", "a\n" * 5 + "z\nmore\n", True),
    ],
)
def test_missing_final_newline_survives(old: str, new: str, marker: bool) -> None:
    text = round_trip(old, new)
    assert ("\\ No newline at end of file\n" in text) == marker


def test_no_newline_marker_is_written_after_the_line() -> None:
    text = encode_delta(3, {"a.py": ("a\nb", "a\nb\n", "tree04/a.py")})
    assert text.endswith("@@ -2 +2 @@\n-b\n\\ No newline at end of file\n")


def test_a_change_only_in_the_final_newline() -> None:
    # The successor lacks the final newline: the hunk's one "-" line reads like the successor's
    # last line, and the difference is the "\n" that the "-" line has and the successor's lacks.
    assert round_trip("a\nb\n", "a\nb") == "--- tree03/a.py\n+++ tree04/a.py\n@@ -2 +2 @@\n-b\n"
    # Tree N lacks it: the marker follows the "-" line.
    assert round_trip("a\nb", "a\nb\n") == (
        "--- tree03/a.py\n+++ tree04/a.py\n@@ -2 +2 @@\n-b\n\\ No newline at end of file\n"
    )
    fd = section("a\nb\n", "a\nb")
    assert rebuild(fd, "a\nb\n") == "a\nb\n"  # the successor got its newline back: tree N stays
    fd = section("a\nb", "a\nb\n")
    with pytest.raises(DeltaError, match=r"hunk 1 \(@@ -2 \+2 @@\) does not fit .* ends the file"):
        rebuild(fd, "a\nb\nc\n")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("a\r\nb\r\nc\r\n", "a\r\nB\r\nc\r\n"),  # CRLF lines
        ("a\nb\rc\nd\n", "a\nb\rC\nd\n"),  # a lone "\r" inside a line
        ("a\r\n", "a\n"),  # only the "\r" differs
        ("x\r", "x\r\n"),
        ("page 1\n\x0c\npage 2\n", "page 1\n\x0c\npage two\n"),  # form feed line
        ("a\x0cb\nc\n", "a\x0cB\nc\n"),  # form feed inside a line
        ("x\x0b\x1c\x1d\x1e\x85\u2028\u2029y\n", "x\n"),  # what str.splitlines splits on
        ("ünïcødé ✓\n", "ünïcødé ✗\n"),
    ],
)
def test_odd_characters_survive(old: str, new: str) -> None:
    round_trip(old, new)


def test_lines_that_look_like_patch_syntax_survive() -> None:
    old = "--- tree03/a.py\n+++ repo/a.py\n@@ -1 +1 @@\n\\ No newline at end of file\n-x\n+y\n"
    new = "--- tree03/a.py\n+++ tree09/a.py\n@@ -1 +1 @@\n\\ No newline at end of file\n+y\n"
    round_trip(old, new)
    round_trip(old, "")
    round_trip("", old)


def test_multi_hunk_file() -> None:
    old = lines_text(40)
    new_lines = split_lines(old)
    new_lines[2] = "changed 3\n"
    del new_lines[15:18]
    new_lines.insert(30, "inserted\n")
    new_lines[-1] = "last, changed\n"
    new = "".join(new_lines)
    fd = section(old, new)
    assert [h.header for h in fd.hunks] == [
        "@@ -3 +3 @@",
        "@@ -16,3 +15,0 @@",
        "@@ -33,0 +31 @@",
        "@@ -40 +38 @@",
    ]
    assert rebuild(fd, new) == old
    round_trip(old, new)


def test_several_files_in_one_patch() -> None:
    files = {
        "minisgl/a.py": (lines_text(10), lines_text(10, "x"), "tree04/minisgl/a.py"),
        "tests/t.py": ("t\n", "", DEV_NULL),
        "minisgl/b.py": ("b\nc", "b\nc\nd\n", "repo/python/minisgl/b.py"),
    }
    sections = parse_delta(encode_delta(3, files), PATCH)
    assert list(sections) == sorted(files)
    for path, (old, new, label) in files.items():
        fd = sections[path]
        assert fd.new_label == label
        check_successor(fd, label, PATCH)
        assert apply_reverse(new, fd.hunks, patch=PATCH, path=path, successor=label) == old


def test_read_patch_keeps_carriage_returns(tmp_path: Path) -> None:
    old, new = "a\r\nb\rc\n", "a\r\nB\rc\n"
    text = encode_delta(3, {"a.py": (old, new, "tree04/a.py")})
    file = tmp_path / "delta.patch"
    file.write_bytes(text.encode("utf-8"))
    fd = read_patch(file, PATCH)["a.py"]
    assert rebuild(fd, new) == old
    with pytest.raises(DeltaError, match="not UTF-8"):
        file.write_bytes(b"--- tree03/a.py\n+++ \xff\n")
        read_patch(file)


def random_text(rng: random.Random) -> str:
    pieces = ["a", "b", "c", "", " ", "\r", "\x0c", "-", "+", "@@", "\\", "ü"]
    lines = [
        "".join(rng.choice(pieces) for _ in range(rng.randint(0, 3)))
        for _ in range(rng.randint(0, 12))
    ]
    text = "\n".join(lines)
    return text + "\n" if lines and rng.random() < 0.7 else text


def random_edit(rng: random.Random, text: str) -> str:
    lines = split_lines(text)
    for _ in range(rng.randint(0, 4)):
        k = rng.randint(0, len(lines))
        op = rng.choice(["insert", "delete", "replace", "newline"])
        fresh = rng.choice(["new\n", "a\n", "\n", "\r\n", "b\x0c\n", "x"])
        if op == "insert":
            lines.insert(k, fresh)
        elif lines and op == "delete":
            del lines[min(k, len(lines) - 1)]
        elif lines and op == "replace":
            lines[min(k, len(lines) - 1)] = fresh
        elif lines:
            last = lines[-1]
            lines[-1] = last[:-1] if last.endswith("\n") else last + "\n"
    # keep the result a text: a line without "\n" may only come last
    joined = "".join(line if line.endswith("\n") else line + "\n" for line in lines[:-1])
    return joined + (lines[-1] if lines else "")


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_random_round_trips(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):  # 10 seeds x 20 = 200 random pairs
        old = random_text(rng)
        new = random_edit(rng, old) if rng.random() < 0.8 else random_text(rng)
        label = DEV_NULL if not new and rng.random() < 0.5 else "tree04/a.py"
        text = round_trip(old, new, label)
        assert encode_delta(3, {"a.py": (old, new, label)}) == text  # deterministic
        if old == new and label != DEV_NULL:
            continue
        hunks = parse_delta(text, PATCH)["a.py"].hunks
        assert sum(h.old_len for h in hunks) == text.count("\n-")  # only tree N's lines
        # Applied to another text, the hunks give some text or a DeltaError, nothing else.
        other = random_edit(rng, new) if rng.random() < 0.8 else random_text(rng)
        try:
            apply_reverse(other, hunks, patch=PATCH, path="a.py", successor=label)
        except DeltaError as exc:
            assert "does not fit" in str(exc) and "steps.py record" in str(exc)


def test_hunks_hold_no_successor_line_and_no_context() -> None:
    old = lines_text(30)
    new = old.replace("line 5\n", "line five\n").replace("line 20\n", "")
    text = encode_delta(3, {"a.py": (old, new, "tree04/a.py")})
    assert text == (
        "--- tree03/a.py\n+++ tree04/a.py\n"
        "@@ -5 +5 @@\n-line 5\n"  # a replacement: tree N's line only
        "@@ -20 +19,0 @@\n-line 20\n"  # tree N's extra line 20, after the successor's line 19
    )
    top = encode_delta(3, {"a.py": ("extra\n" + old, old, "tree04/a.py")})
    assert top.endswith("@@ -1 +0,0 @@\n-extra\n")  # before the successor's first line


# ---------------------------------------------------------------------------- stale deltas

STALE = "the successor changed without its delta being re-derived (run `steps.py record`)"


def test_a_hunk_outside_the_successor_names_the_hunk_and_the_lines() -> None:
    old = lines_text(30)
    new = old.replace("line 5\n", "line five\n").replace("line 20\n", "line twenty\n")
    fd = section(old, new)
    assert [h.header for h in fd.hunks] == ["@@ -5 +5 @@", "@@ -20 +20 @@"]
    with pytest.raises(DeltaError) as info:
        rebuild(fd, lines_text(15))  # the successor got shorter, nobody ran `record`
    assert str(info.value) == (
        f"{PATCH}: a.py: hunk 2 (@@ -20 +20 @@) does not fit tree04/a.py: it replaces line 20, "
        f"but the successor has 15 lines; {STALE}"
    )
    fd = section(old, new.replace("line 11\n", "eleven\nand more\n"))
    assert [h.header for h in fd.hunks] == ["@@ -5 +5 @@", "@@ -11 +11,2 @@", "@@ -20 +21 @@"]
    with pytest.raises(DeltaError, match=r"hunk 2 \(@@ -11 \+11,2 @@\) does not fit tree04/a\.py: "
                       r"it replaces lines 11 to 12, but the successor has 11 lines"):
        rebuild(fd, lines_text(11))


def test_no_content_check_a_stale_successor_gives_another_text() -> None:
    # A hunk holds none of the successor's lines: where its ranges still fit, a changed
    # successor gives another tree N, and tree N's digest (property 8) is what catches it.
    old = lines_text(30)
    new = old.replace("line 20\n", "line twenty\n")
    fd = section(old, new)
    assert rebuild(fd, new.replace("line twenty", "line 20, edited")) == old  # inside the range
    edited = new.replace("line 25\n", "an edit nobody recorded\n")  # outside it
    assert rebuild(fd, edited) == old.replace("line 25\n", "an edit nobody recorded\n")
    shifted = rebuild(fd, "a line added at the top\n" + new)  # no offset search
    tail = "".join(f"line {k}\n" for k in range(21, 31))
    assert shifted == "a line added at the top\n" + lines_text(18) + "line 20\nline twenty\n" + tail


def test_stale_hunk_at_the_end_of_the_successor() -> None:
    old = lines_text(10)
    new = lines_text(9) + "line ten\n"
    fd = section(old, new)
    with pytest.raises(DeltaError, match=r"replaces line 10, but the successor has 9 lines"):
        rebuild(fd, lines_text(9))
    assert rebuild(fd, lines_text(9) + "line ten") == old  # the replaced line's newline is moot


def test_stale_hunk_that_ends_a_file_without_a_final_newline() -> None:
    fd = section("a\nb", "a\nb\n")
    assert rebuild(fd, "a\nb\n") == "a\nb"
    with pytest.raises(DeltaError) as info:
        rebuild(fd, "a\nb\nappended\n")
    assert str(info.value) == (
        f"{PATCH}: a.py: hunk 1 (@@ -2 +2 @@) does not fit tree04/a.py: the hunk ends the file, "
        f"but the successor goes on at line 3 with 'appended'; {STALE}"
    )


def test_lines_after_a_successor_that_lost_its_final_newline_fail() -> None:
    # Tree N has a line after the successor's last; that line lost its "\n" since: putting
    # tree N's line after it would join the two lines.
    fd = section("a\nb\nc\n", "a\nb\n")
    assert [h.header for h in fd.hunks] == ["@@ -3 +2,0 @@"]
    assert rebuild(fd, "a\nb\n") == "a\nb\nc\n"
    with pytest.raises(DeltaError) as info:
        rebuild(fd, "a\nb")
    assert str(info.value) == (
        f"{PATCH}: a.py: hunk 1 (@@ -3 +2,0 @@) does not fit tree04/a.py: it puts lines after "
        f"line 2, the successor's last, which has no newline at end of file; {STALE}"
    )
    # A hunk that replaces that last line is fine: the successor's line is not kept.
    fd = section("a\nb\nc\n", "a\nB")
    assert rebuild(fd, "a\nB") == "a\nb\nc\n"


def test_stale_pure_insertion_past_the_end_fails() -> None:
    # tree N's extra line 6 goes after the successor's line 5
    fd = section(lines_text(6), lines_text(5))
    assert [h.header for h in fd.hunks] == ["@@ -6 +5,0 @@"]
    assert rebuild(fd, lines_text(5)) == lines_text(6)
    with pytest.raises(DeltaError, match=r"hunk 1 \(@@ -6 \+5,0 @@\) does not fit tree04/a\.py: it "
                       r"goes after line 5, but the successor has 3 lines"):
        rebuild(fd, lines_text(3))
    with pytest.raises(DeltaError, match=r"goes after line 5, but the successor has 1 line;"):
        rebuild(fd, "x\n")


def test_apply_refuses_hunks_out_of_order_or_overlapping() -> None:
    old = lines_text(30)
    new = old.replace("line 5\n", "5\n").replace("line 20\n", "20\n")
    fd = section(old, new)
    with pytest.raises(DeltaError, match=r"hunk 2 \(@@ -5 \+5 @@\) is misnumbered"):
        apply_reverse(new, fd.hunks[::-1], patch=PATCH, path="a.py", successor="tree04/a.py")
    wide = Hunk("@@ -4,3 +4,3 @@", 4, 3, 4, 3, ("4\n", "5\n", "6\n"))
    inner = Hunk("@@ -5 +5 @@", 5, 1, 5, 1, ("five\n",))
    with pytest.raises(DeltaError, match=r"hunk 2 \(@@ -5 \+5 @@\) is misnumbered"):
        apply_reverse(new, [wide, inner], patch=PATCH, path="a.py", successor="tree04/a.py")
    short = Hunk("@@ -5,2 +5,2 @@", 5, 2, 5, 2, ("five\n",))  # fewer lines than it counts
    with pytest.raises(DeltaError, match=r"hunk 1 \(@@ -5,2 \+5,2 @@\) is misnumbered"):
        apply_reverse(new, [short], patch=PATCH, path="a.py", successor="tree04/a.py")


# ---------------------------------------------------------------------------- the +++ label


def test_wrong_successor_label_names_both_labels() -> None:
    fd = section("a\n", "b\n", "tree04/a.py")
    check_successor(fd, "tree04/a.py", PATCH)
    with pytest.raises(DeltaError) as info:
        check_successor(fd, "repo/a.py", PATCH)
    message = str(info.value)
    assert message.startswith(f"{PATCH}: a.py: ")
    assert "against tree04/a.py but the successor is now repo/a.py" in message
    assert "steps.py record" in message


# ---------------------------------------------------------------------------- malformed patches

GOOD = (
    "--- tree03/a.py\n"
    "+++ tree04/a.py\n"
    "@@ -3 +3 @@\n"
    "-3\n"
    "@@ -9,0 +10 @@\n"
    "@@ -12,2 +13 @@\n"
    "-12\n"
    "-13\n"
)
GOOD_OLD = "".join(f"{k}\n" for k in range(1, 16))  # tree 3's a.py
GOOD_NEW = GOOD_OLD.replace("3\n", "three\n", 1).replace("9\n", "9\n9.5\n").replace(
    "12\n13\n", "twelve and thirteen\n"
)


def bad(text: str, pattern: str) -> None:
    with pytest.raises(DeltaError, match=pattern):
        parse_delta(text, PATCH)


def test_the_good_patch_parses() -> None:
    fd = parse_delta(GOOD, PATCH)["a.py"]
    assert fd == FileDelta(
        "a.py",
        "tree03/a.py",
        "tree04/a.py",
        (
            Hunk("@@ -3 +3 @@", 3, 1, 3, 1, ("3\n",)),
            Hunk("@@ -9,0 +10 @@", 9, 0, 10, 1, ()),
            Hunk("@@ -12,2 +13 @@", 12, 2, 13, 1, ("12\n", "13\n")),
        ),
    )
    assert rebuild(fd, GOOD_NEW) == GOOD_OLD
    assert encode_delta(3, {"a.py": (GOOD_OLD, GOOD_NEW, "tree04/a.py")}) == GOOD
    assert parse_delta("", PATCH) == {}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("@@ -9,0 +11 @@", r"a\.py: hunk 2 \(@@ -9,0 \+11 @@\) is misnumbered"),
        ("@@ -2,0 +3 @@", r"a\.py: hunk 2 \(@@ -2,0 \+3 @@\) is misnumbered"),
        ("@@ -0,0 +0,0 @@", r"a\.py: hunk 2 \(@@ -0,0 \+0,0 @@\) is misnumbered"),
    ],
)
def test_misnumbered_hunk_header_fails_in_the_reader(header: str, message: str) -> None:
    bad(GOOD.replace("@@ -9,0 +10 @@", header), PATCH.replace(".", r"\.") + ":5: " + message)


def test_misnumbered_first_hunk_fails_in_the_reader() -> None:
    bad(GOOD.replace("@@ -3 +3 @@", "@@ -3 +4 @@"), r":3: a\.py: hunk 1 .* misnumbered")


def test_body_with_fewer_lines_than_the_header_fails() -> None:
    text = GOOD.replace("@@ -3 +3 @@", "@@ -3,2 +3,2 @@")
    bad(
        text,
        r":5: a\.py: hunk 1 \(@@ -3,2 \+3,2 @@\): its body has 1 of the 2 '-' lines its header "
        r"counts; found '@@ -9,0 \+10 @@'",
    )
    bad(GOOD[: GOOD.index("-13\n")], r":8: a\.py: hunk 3 .* found the end of the patch")


def test_body_with_more_lines_than_the_header_fails() -> None:
    bad(GOOD + "-14\n", r":9: a\.py: hunk 3 \(@@ -12,2 \+13 @@\) has more lines than its header "
        r"counts: '-14'")
    bad(GOOD.replace("@@ -3 +3 @@", "@@ -2,0 +3 @@"), r":4: a\.py: hunk 1 .* has more lines")
    bad(
        GOOD.replace("@@ -9,0 +10 @@\n", "@@ -9,0 +10 @@\n-9\n"),
        r":6: a\.py: hunk 2 \(@@ -9,0 \+10 @@\) has more lines than its header counts: '-9'",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("garbage\n" + GOOD, r":1: expected a '--- treeNN/<path>' line, found 'garbage'"),
        (GOOD + "garbage\n", r":9: a\.py: expected a hunk header .* found 'garbage'"),
        (GOOD.replace("-12\n", "?12\n"), r":7: a\.py: hunk 3 .* found '\?12'"),
        (GOOD.replace("-12\n", "\n"), r":7: a\.py: hunk 3 .* found ''"),
        (GOOD.replace("@@ -3 +3 @@", "@@ -3 +3 @@ def f():"), r"bad hunk header"),
        (GOOD.replace("@@ -3 +3 @@", "@@ -03 +3 @@"), r"bad hunk header"),
        (GOOD.replace("+++ tree04/a.py", "+++ "), r":2: a\.py: expected '\+\+\+ <label>'"),
        (GOOD.replace("+++ tree04/a.py\n", ""), r":2: a\.py: expected '\+\+\+ <label>'"),
        ("--- tree03/a.py\n", r"found the end of the patch"),
        (GOOD.replace("tree03/a.py", "a.py"), r":1: 'a\.py' is not 'treeNN/<path>'"),
        (GOOD + GOOD, r":9: a\.py has a second section"),
        (GOOD + GOOD.replace("tree03/a.py", "tree05/b.py"), r":9: b\.py: tree05, not tree03"),
        (GOOD[:-1], r"the last line has no newline"),
        ("--- tree03/a.py\n+++ tree04/a.py\n", r":1: a\.py: a section without hunks"),
        (GOOD.replace("-3\n", "-3\n\\ No newline at end of file\n"), r"hunk 2 .* follows the end"),
        (GOOD.replace("-12\n", "-12\n\\ No newline at end of file\n"), r":9: .* follows the end"),
        (GOOD + 2 * "\\ No newline at end of file\n", r"hunk 3 .* more lines than its header"),
        (
            GOOD.replace("@@ -9,0 +10 @@\n", "@@ -9,0 +10 @@\n\\ No newline at end of file\n"),
            r":6: a\.py: hunk 2 .* has more lines than its header counts",
        ),
        (GOOD.replace("@@ -3 +3 @@", "@@ -3,0 +3,0 @@"), r"hunk 1 .* is misnumbered"),
        (
            GOOD.replace("-3\n", " 3\n"),  # a context line: tree N's lines are `-` lines only
            r":4: a\.py: hunk 1 \(@@ -3 \+3 @@\): its body has 0 of the 1 '-' lines its header "
            r"counts; found ' 3'",
        ),
        (GOOD.replace("-3\n", "-3\n+three\n"), r":5: a\.py: hunk 1 .* has more lines than"),
    ],
)
def test_malformed_patch_fails_naming_the_place(text: str, message: str) -> None:
    bad(text, message)


def test_hunk_after_one_that_ends_the_file_fails() -> None:
    text = (
        "--- tree03/a.py\n+++ tree04/a.py\n@@ -1 +1 @@\n-a\n\\ No newline at end of file\n"
        "@@ -3 +3 @@\n-c\n"
    )
    bad(text, r":6: a\.py: hunk 2 \(@@ -3 \+3 @@\) follows the end of the file")


def test_error_messages_carry_the_patch_name() -> None:
    with pytest.raises(DeltaError) as info:
        parse_delta(GOOD.replace("@@ -9,0 +10 @@", "@@ -9,0 +11 @@"), PATCH)
    assert re.match(re.escape(PATCH) + r":5: a\.py: hunk 2 ", str(info.value))


def test_misnumbered_message_says_where_the_hunk_should_start() -> None:
    bad(
        GOOD.replace("@@ -12,2 +13 @@", "@@ -12,2 +12 @@"),
        r"hunk 3 \(@@ -12,2 \+12 @@\) is misnumbered: the hunks before it shift lines by 1, so "
        r"its new range should start at 13, not 12",
    )
    bad(
        GOOD.replace("@@ -9,0 +10 @@", "@@ -2,0 +3 @@"),
        r"hunk 2 \(@@ -2,0 \+3 @@\) is misnumbered: it starts before the end of hunk 1",
    )


# ---------------------------------------------------------------------------- renames

MOVED = "rename from a.py\nrename to pkg/b.py\n--- tree03/a.py\n+++ tree04/pkg/b.py\n"


def test_a_rename_is_written_the_way_git_writes_one() -> None:
    old = lines_text(20)
    new = old.replace("line 1\n", "moved line 1\n")
    text = encode_delta(3, {"a.py": (old, new, "tree04/pkg/b.py")})
    assert text == MOVED + "@@ -1 +1 @@\n-line 1\n"
    fd = parse_delta(text, PATCH)["a.py"]
    assert (fd.rename, fd.old_label, fd.new_label) == ("pkg/b.py", "tree03/a.py", "tree04/pkg/b.py")
    assert rebuild(fd, new) == old
    assert section_length("a.py", old, new, "tree04/pkg/b.py") == text.count("\n") == 6


def test_a_file_moved_unchanged_is_a_rename_without_hunks() -> None:
    old = lines_text(20)
    text = encode_delta(3, {"a.py": (old, old, "tree04/pkg/b.py")})
    assert text == MOVED
    fd = parse_delta(text, PATCH)["a.py"]
    assert fd.hunks == () and fd.rename == "pkg/b.py" and rebuild(fd, old) == old
    assert parse_delta(GOOD, PATCH)["a.py"].rename is None


def test_renames_and_plain_sections_mix_in_path_order() -> None:
    files = {
        "z.py": ("1\n", "2\n", "tree04/z.py"),
        "a.py": (lines_text(9), lines_text(9), "tree04/pkg/b.py"),
        "m.py": ("x\n", "", DEV_NULL),
    }
    text = encode_delta(3, files)
    assert text.startswith(MOVED + "--- tree03/m.py\n+++ /dev/null\n")
    sections = parse_delta(text, PATCH)
    assert list(sections) == ["a.py", "m.py", "z.py"]
    assert [fd.rename for fd in sections.values()] == ["pkg/b.py", None, None]


def test_encode_refuses_two_renames_to_one_path() -> None:
    files = {"a.py": ("1\n", "1\n", "tree04/c.py"), "b.py": ("1\n", "1\n", "tree04/c.py")}
    with pytest.raises(ValueError, match="b.py: a second rename to c.py"):
        encode_delta(3, files)


RENAMED_C = MOVED.replace("a.py", "c.py")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rename from a.py\nrenamed to b.py\n", r":2: a\.py: expected 'rename to <path>'"),
        ("rename from a.py\n", r":2: a\.py: expected 'rename to <path>' .* end of the patch"),
        ("rename from a.py\nrename to \n", r":2: a\.py: expected 'rename to <path>'"),
        ("rename from a.py\nrename to b.py\n", r":3: expected a '--- treeNN/<path>' line after"),
        (
            MOVED.replace("rename from a.py", "rename from c.py"),
            r":1: 'rename from c\.py' opens the section of a\.py",
        ),
        (
            MOVED.replace("tree04/pkg/b.py", "tree04/pkg/c.py"),
            r":4: a\.py: 'rename to pkg/b\.py' but the '\+\+\+' label is tree04/pkg/c\.py",
        ),
        (
            MOVED.replace("tree04/pkg/b.py", "repo/pkg/b.py"),
            r"label is repo/pkg/b\.py, not treeNN/pkg/b\.py",
        ),
        (MOVED.replace("pkg/b.py", "a.py"), r":1: a\.py: renamed to itself"),
        (
            MOVED[MOVED.index("---") :],
            r":2: a\.py: the '\+\+\+' label tree04/pkg/b\.py names another path, but the "
            r"section has no 'rename from' / 'rename to' lines",
        ),
        (
            MOVED + RENAMED_C,
            r":5: c\.py: renamed to pkg/b\.py, which a\.py is renamed to already",
        ),
        (GOOD + "rename from x\n", r":10: x: expected 'rename to <path>'"),
        (
            MOVED + "garbage\n",
            r":5: a\.py: expected a hunk header or the next file's '--- ' or 'rename from' line",
        ),
    ],
)
def test_malformed_renames_fail_naming_the_place(text: str, message: str) -> None:
    bad(text, message)


def test_a_stale_rename_fails_like_any_hunk() -> None:
    old = lines_text(20)
    new = old.replace("line 10\n", "line ten\n")
    fd = parse_delta(encode_delta(3, {"a.py": (old, new, "tree04/pkg/b.py")}), PATCH)["a.py"]
    stale = r"hunk 1 \(@@ -10 \+10 @@\) does not fit tree04/pkg/b\.py: it replaces line 10, but"
    with pytest.raises(DeltaError, match=stale):
        apply_reverse(lines_text(5), fd.hunks, patch=PATCH, path="a.py", successor=fd.new_label)


def gone(path: str, text: str) -> dict[str, tuple[str, str, str]]:
    return {path: (text, "", DEV_NULL)}


def test_find_renames_pairs_a_moved_file() -> None:
    old = lines_text(30)
    added = {"new/a.py": old.replace("line 7\n", "line seven\n"), "other.py": lines_text(30, "x")}
    assert find_renames(gone("a.py", old), added, 4) == {"a.py": "new/a.py"}
    assert find_renames(gone("a.py", old), {"other.py": lines_text(30, "x")}, 4) == {}
    assert find_renames(gone("a.py", old), {}, 4) == {}


def test_find_renames_takes_a_rename_only_when_it_is_shorter() -> None:
    old = lines_text(4)
    # Half the file changed: the rename (4 header lines, a hunk with tree N's 2 lines) is as
    # long as old whole (2 labels, a hunk with 4 lines), not shorter.
    half = "line 1\nline 2\nnew 3\nnew 4\nnew 5\n"
    plain = section_length("a.py", old, "", DEV_NULL)
    assert section_length("a.py", old, half, "tree04/b.py") == plain == 7
    assert find_renames(gone("a.py", old), {"b.py": half}, 4) == {}
    # The live copy is the same: no section at all, so no rename, even to an identical file.
    assert find_renames({"a.py": (old, old, "repo/a.py")}, {"b.py": old}, 4) == {}
    # The live copy needs a 4-line section, no longer than the 4-line rename: no rename.
    live = {"a.py": (old, old.replace("line 4", "line four"), "repo/a.py")}
    assert find_renames(live, {"b.py": old}, 4) == {}
    # The live copy needs a 6-line section (two hunks), the identical new file a 4-line rename.
    live = {"a.py": (old, old.replace("line 1", "one").replace("line 4", "four"), "repo/a.py")}
    assert section_length("a.py", *live["a.py"]) == 6
    assert find_renames(live, {"b.py": old}, 4) == {"a.py": "b.py"}
    # A tiny file never pays for the rename header.
    assert find_renames(gone("a.py", "x\n"), {"b.py": "x\n"}, 4) == {}


def test_find_renames_is_deterministic_and_pairs_each_path_once() -> None:
    base = lines_text(40)
    c = base.replace("line 5\n", "5\n")
    b = c.replace("line 25\n", "25\n")
    # Savings: d.py -> c.py 39 lines (identical), a.py -> c.py and d.py -> b.py 37 each,
    # a.py -> b.py 35. The biggest saving goes first, ties in path order, each path once;
    # e.py resembles nothing.
    olds = {**gone("a.py", base), **gone("d.py", c), **gone("e.py", lines_text(40, "e"))}
    added = {"b.py": b, "c.py": c}
    want = {"d.py": "c.py", "a.py": "b.py"}
    assert find_renames(olds, added, 4) == want
    backwards = dict(reversed(list(olds.items()))), dict(reversed(list(added.items())))
    assert find_renames(*backwards, 4) == want
