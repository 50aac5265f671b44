"""Self-tests of tools/steps.py, tools/book/ and tools/mkdocs_hooks.py on small synthetic books."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
STEPS = TOOLS / "steps.py"


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(TOOLS))
from book import delta, outputs  # noqa: E402

# ---------------------------------------------------------------------------- the synthetic book

CH0_MAIN = """\
import naive
from minisgl.util import shout

print(shout(naive.greet()))
"""
NAIVE = '''\
def greet() -> str:
    """Chapter 0's naive part."""
    return "hello from chapter 0"
'''
INIT = '"""A tiny minisgl."""\n'
UTIL = """\
def shout(text: str) -> str:
    return text.upper()
"""
CORE = """\
import datetime
import time

from minisgl.util import shout


class Engine:
    @staticmethod
    def run() -> None:
        start = time.perf_counter()
        print(shout("chapter 1 runs"))
        elapsed = (time.perf_counter() - start) * 1000
        print(f"took {elapsed:.6f} ms at {datetime.datetime.now().isoformat()}")
"""
CH1_MAIN = """\
from minisgl.core import Engine

Engine.run()
"""
TEST0 = """\
import naive


def test_greet():
    assert "chapter 0" in naive.greet()
"""
TEST1 = """\
from minisgl.core import Engine


def test_engine(capsys):
    Engine.run()
    assert "CHAPTER 1" in capsys.readouterr().out
"""
EXAMPLE = "def demo():\n    return 1\n"


def manifest(number: int, slug: str, new: list[str], gone: list[str], outputs: str) -> str:
    """A chapter.toml without a digest (the fixture's `record` writes it)."""
    text = f'title = "第 {number} 章"\npage = "docs/ch{number:02d}-{slug}.md"\n'
    for key, paths in (("new", new), ("gone", gone)):
        if paths:
            text += f"{key} = [\n" + "".join(f'  "{p}",\n' for p in paths) + "]\n"
    return text + outputs


MAIN_OUTPUT = '\n[[output]]\nid = "main"\ncmd = ["python", "main.py"]\nwhere = "tree"\n'
DEMO_OUTPUT = (
    '\n[[output]]\nid = "demo"\n'
    'cmd = ["python", "-c", "import minisgl.core; print(\'repo ok\')"]\nwhere = "repo"\n'
)

PAGE0 = """\
# 第 0 章

<!-- tree: begin -->
<!-- tree: end -->

```python
--8<-- "0:naive.py#greet"
```

<!-- illustration -->
```python
print("an idea, not code of the tree")
```

```py title="main.py"
--8<-- "0:main.py:1:2"
```

## 运行结果

<!-- output: main -->
```text
```
"""
PAGE1 = """\
# 第 1 章

<!-- tree: begin -->
```text
```
<!-- tree: end -->

```python
--8<-- "1:minisgl/core.py#Engine.run"
```

```python
--8<-- "repo:examples/demo.py#demo"
```

<!-- output: main -->

<!-- output: demo -->
```text
```
"""
TREE1 = """\
```text
.
├── minisgl/
│   └── core.py        [新建]
├── tests/
│   └── ch01/
│       └── test_b.py  [新建]
└── main.py            [修改]
```

??? note "未变的文件（2 个）"

    ```text
    .
    └── minisgl/
        ├── __init__.py
        └── util.py
    ```

"""


def steps_cmd(root: Path, *args: str, env: dict[str, str] | None = None):
    """Run `steps.py --root ROOT ARGS` and return the completed process (text)."""
    env = dict(os.environ if env is None else env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # speed
    return subprocess.run(
        [sys.executable, str(STEPS), "--root", str(root), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )


def verdicts(stdout: str) -> dict[str, list[str]]:
    """{chapter header line: its verdict lines, timings masked}, in the order `check` printed."""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("chapter "):
            found[line] = []
        elif line.startswith("  [") and found:
            found[list(found)[-1]].append(outputs.mask(line))
    return found


def failures(stdout: str) -> set[tuple[int, int]]:
    """The (chapter, property) pairs that `check` reported as FAIL."""
    found, chapter = set(), -1
    for line in stdout.splitlines():
        if m := re.match(r"chapter (\d+) ", line):
            chapter = int(m[1])
        elif m := re.match(r"  \[(\d)\] .*? FAIL: ", line):
            found.add((chapter, int(m[1])))
    return found


def write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text, encoding="utf-8")


def steps_ok(root: Path, *commands: list[str]) -> None:
    """Run each `steps.py` command in root in turn; every one must succeed."""
    for args in commands:
        done = steps_cmd(root, *args)
        assert done.returncode == 0, done.stdout + done.stderr


def edit(root: Path, path: str, old: str, new: str) -> None:
    text = (root / path).read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in {path}"
    (root / path).write_text(text.replace(old, new), encoding="utf-8")


@pytest.fixture(scope="session")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A healthy two-chapter book; its digests come from `record`, its blocks from `pages`."""
    root = tmp_path_factory.mktemp("book")
    ch0 = ["main.py", "naive.py", "minisgl/__init__.py", "minisgl/util.py", "tests/ch00/test_a.py"]
    ch1 = ["minisgl/core.py", "tests/ch01/test_b.py"]
    files = {
        "chapters/ch00_a/chapter.toml": manifest(0, "a", ch0, [], MAIN_OUTPUT),
        "chapters/ch00_a/main.py": CH0_MAIN,
        "chapters/ch00_a/naive.py": NAIVE,
        "chapters/ch01_b/chapter.toml": manifest(
            1, "b", ch1, ["naive.py", "tests/ch00/test_a.py"], MAIN_OUTPUT + DEMO_OUTPUT
        ),
        "chapters/ch01_b/main.py": CH1_MAIN,
        "python/minisgl/__init__.py": INIT,
        "python/minisgl/util.py": UTIL,
        "python/minisgl/core.py": CORE,
        "tests/ch00/test_a.py": TEST0,
        "tests/ch01/test_b.py": TEST1,
        "examples/demo.py": EXAMPLE,
        "docs/ch00-a.md": PAGE0,
        "docs/ch01-b.md": PAGE1,
    }
    for path, text in files.items():
        write(root, path, text)
    steps_ok(root, ["record"], ["pages"])
    return root


@pytest.fixture
def repo(template: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(template, root, symlinks=True)
    return root


def check_fails(root: Path, *args: str, expect: set[tuple[int, int]], message: str) -> str:
    done = steps_cmd(root, "check", *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert failures(done.stdout) == expect, done.stdout
    assert message in done.stdout, done.stdout
    return done.stdout


# ---------------------------------------------------------------------------- healthy book


def test_healthy_book_passes_every_property(repo: Path) -> None:
    done = steps_cmd(repo, "check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "summary: 15 ok, 0 failed, 0 skipped" in done.stdout
    page1 = (repo / "docs/ch01-b.md").read_text(encoding="utf-8")
    assert "CHAPTER 1 RUNS\ntook " in page1 and "repo ok" in page1  # pages inserted the blocks


def test_jobs_check_chapters_at_once_with_the_same_verdicts(repo: Path) -> None:
    serial = steps_cmd(repo, "check")
    both = steps_cmd(repo, "check", "--jobs", "2")
    assert both.returncode == 0, both.stdout + both.stderr
    assert verdicts(both.stdout) == verdicts(serial.stdout)
    assert sorted(len(v) for v in verdicts(both.stdout).values()) == [8, 8]
    assert "summary: 15 ok, 0 failed, 0 skipped" in both.stdout
    # A failure in one chapter is reported under that chapter and fails the run.
    edit(repo, "chapters/ch00_a/main.py", "import naive\n", "import naive\nimport minisgl.core\n")
    assert steps_cmd(repo, "record", "0").returncode == 0
    check_fails(repo, "--jobs", "2", expect={(0, 2), (0, 6)}, message="minisgl.core is not in")


def test_pages_filled_in_the_blocks(repo: Path) -> None:
    page0 = (repo / "docs/ch00-a.md").read_text(encoding="utf-8")
    assert "<!-- tree: begin -->\n```text\n.\n├── minisgl/" in page0
    assert "<!-- output: main -->\n```text\nHELLO FROM CHAPTER 0\n```" in page0
    page1 = (repo / "docs/ch01-b.md").read_text(encoding="utf-8")
    assert f"<!-- tree: begin -->\n{TREE1}<!-- tree: end -->" in page1


def test_masking_hides_timings_and_dates(repo: Path) -> None:
    # The page holds one run's timing and date, check compares with another run's.
    page1 = (repo / "docs/ch01-b.md").read_text(encoding="utf-8")
    assert re.search(r"took \d+\.\d{6} ms at \d{4}-\d\d-\d\dT", page1)
    assert steps_cmd(repo, "check", "1").returncode == 0
    assert outputs.mask("took 12.5 ms, 3,200.5 tok/s, 1.5GiB at 2024-05-01T10:00:00.123") == (
        "took <N ms>, <N tok/s>, <N GiB> at <date>"
    )
    assert (
        outputs.mask("耗时 12 秒, 3 steps, 2 users, x1 s") == "耗时 <N 秒>, 3 steps, 2 users, x1 s"
    )
    assert outputs.mask("12:30:01 done in 4 min") == "<date> done in <N min>"
    assert outputs.outputs_match("seed 7 gives 3 tokens  # mask-line\n", "seed 9 gives 4 tokens")
    assert not outputs.outputs_match("seed 7\n", "seed 9\n")
    assert outputs.outputs_match("a  \nb\n\n", "a\nb")


# ---------------------------------------------------------------------------- breakages


def test_a_main_importing_a_module_outside_its_tree_fails(repo: Path) -> None:
    edit(repo, "chapters/ch00_a/main.py", "import naive\n", "import naive\nimport minisgl.core\n")
    assert steps_cmd(repo, "record", "0").returncode == 0
    out = check_fails(
        repo, "0", expect={(0, 2), (0, 6)}, message="minisgl.core is not in this chapter's tree"
    )
    assert "[7] every file used" in out and "skipped" in out


def test_an_installed_minisgl_cannot_leak_in(repo: Path, tmp_path: Path) -> None:
    # An installed minisgl outside the tree: on the parent's PYTHONPATH and put on sys.path.
    site = tmp_path / "site"
    write(site, "minisgl/__init__.py", "")
    write(site, "minisgl/util.py", UTIL)
    write(site, "minisgl/core.py", "LEAKED = True\n")
    leak = f"import sys\nsys.path.insert(0, {str(site)!r})\nimport minisgl.core\n"
    edit(repo, "chapters/ch00_a/main.py", "import naive\n", leak + "import naive\n")
    assert steps_cmd(repo, "record", "0").returncode == 0
    # Control: without the isolation the import succeeds.
    assert steps_cmd(repo, "build", "0", str(tmp_path / "built")).returncode == 0
    plain = subprocess.run(
        [sys.executable, "main.py"],
        cwd=tmp_path / "built",
        check=False,
        capture_output=True,
        text=True,
    )
    assert plain.returncode == 0, plain.stderr
    env = dict(os.environ, PYTHONPATH=str(site))
    done = steps_cmd(repo, "check", "0", env=env)
    assert done.returncode == 1 and failures(done.stdout) == {(0, 2), (0, 6)}, done.stdout
    assert "minisgl.core is not in this chapter's tree" in done.stdout


def test_b_tree_block_disagreeing_with_the_manifest_fails(repo: Path) -> None:
    edit(repo, "docs/ch01-b.md", "core.py        [新建]", "core.py        [修改]")
    check_fails(repo, "--no-run", expect={(1, 5)}, message="the tree block differs")


def test_c_pasted_python_block_fails(repo: Path) -> None:
    edit(
        repo,
        "docs/ch00-a.md",
        "## 运行结果",
        "```python\ndef greet():\n    ...\n```\n\n## 运行结果",
    )
    check_fails(repo, "--no-run", expect={(0, 5)}, message="python block pasted, not included")


def test_d_stale_output_fails(repo: Path) -> None:
    edit(repo, "docs/ch00-a.md", "HELLO FROM CHAPTER 0", "HELLO FROM CHAPTER ZERO")
    check_fails(repo, "0", expect={(0, 6)}, message="no longer matches a fresh run")
    assert steps_cmd(repo, "pages", "0").returncode == 0
    assert steps_cmd(repo, "check", "0").returncode == 0


def test_e_unused_file_in_a_tree_fails(repo: Path) -> None:
    write(repo, "chapters/ch00_a/extra.py", "X = 1\n")
    edit(repo, "chapters/ch00_a/chapter.toml", "new = [\n", 'new = [\n  "extra.py",\n')
    edit(repo, "chapters/ch01_b/chapter.toml", "gone = [\n", 'gone = [\n  "extra.py",\n')
    assert steps_cmd(repo, "record", "0").returncode == 0
    assert steps_cmd(repo, "pages", "0").returncode == 0
    check_fails(
        repo,
        "0",
        expect={(0, 7)},
        message="tree 0 holds extra.py but neither main.py nor the tests import it",
    )


def test_f_a_leaked_live_edit_fails(repo: Path) -> None:
    edit(repo, "python/minisgl/util.py", "return", "return  # louder\n    return")
    message = "tree 0 changed: if chapter 0 meant it, run `steps.py record 0`; if a later edit"
    check_fails(repo, "--no-run", expect={(0, 8), (1, 8)}, message=message)


STALE_DELTA_0 = (
    "tree 0 changed: if chapter 0 meant it, run `steps.py record 0`; if a later edit leaked in "
    "(a later tree or the live code changed without `steps.py record`, so chapter 0's "
    "delta.patch is stale), run `steps.py record`"
)


def test_f_a_stale_delta_fails_to_materialise(repo: Path) -> None:
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "book")
    edit(repo, "python/minisgl/util.py", "return", "# chapter 1 polishes this\n    return")
    assert steps_cmd(repo, "record").returncode == 0
    # The successor got shorter: tree 0's hunk replaces its line 2, which is gone.
    write(repo, "python/minisgl/util.py", "def shout(text: str) -> str: return text.upper()\n")
    check_fails(
        repo,
        "--no-run",
        expect={(0, 1), (1, 5), (1, 8)},  # tree 1's block needs tree 0 to say what changed
        message="chapters/ch00_a/delta.patch: minisgl/util.py: hunk 1 (@@ -1,0 +2 @@) does not "
        "fit tree01/minisgl/util.py: it replaces line 2, but the successor has 1 line; the "
        "successor changed without its delta being re-derived (run `steps.py record`)",
    )


def test_f_a_stale_delta_fails_the_digest(repo: Path, tmp_path: Path) -> None:
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "book")
    edit(repo, "python/minisgl/util.py", "return", "# chapter 1 polishes this\n    return")
    steps_ok(repo, ["record"], ["pages"])
    assert "@@ -1,0 +2 @@\n" in (repo / "chapters/ch00_a/delta.patch").read_text("utf-8")
    # An edit inside the hunk's range: tree 0 still comes back as recorded; tree 1 changed.
    edit(repo, "python/minisgl/util.py", "# chapter 1 polishes this", "# edited again")
    check_fails(repo, "--no-run", expect={(1, 8)}, message="tree 1 changed: if chapter 1 meant")
    # An edit that moves the hunk's line: tree 0 comes back wrong, and its digest says so.
    edit(repo, "python/minisgl/util.py", "def shout", "# a later edit\ndef shout")
    check_fails(repo, "--no-run", expect={(0, 8), (1, 8)}, message=STALE_DELTA_0)
    done = steps_cmd(repo, "build", "0", str(tmp_path / "wrong"))  # written, with a warning
    assert done.returncode == 0 and "warning: tree 0 is not the tree recorded in " in done.stderr
    assert (tmp_path / "wrong/minisgl/util.py").read_text(encoding="utf-8") != UTIL
    # What the message says to do: `record` finds tree 0 at git HEAD by its digest.
    steps_ok(repo, ["record"], ["pages"], ["check", "--no-run"])
    done = steps_cmd(repo, "build", "0", str(tmp_path / "t0"))
    assert done.returncode == 0 and "warning" not in done.stderr
    assert (tmp_path / "t0/minisgl/util.py").read_text(encoding="utf-8") == UTIL


def test_g_failing_chapter_test_fails(repo: Path) -> None:
    edit(repo, "tests/ch01/test_b.py", '"CHAPTER 1"', '"CHAPTER 2"')
    assert steps_cmd(repo, "record").returncode == 0
    check_fails(repo, "1", expect={(1, 3)}, message="pytest exited with 1")


def test_h_python_minisgl_differing_from_newest_tree_fails(repo: Path) -> None:
    write(repo, "python/minisgl/extra.py", "")
    check_fails(
        repo, "--no-run", expect={(1, 4)}, message="python/minisgl/extra.py is not in tree 1"
    )
    (repo / "python/minisgl/extra.py").unlink()
    label = "repo/python/minisgl/core.py"
    patch = delta.encode_delta(1, {"minisgl/core.py": (CORE + "# frozen\n", CORE, label)})
    write(repo, "chapters/ch01_b/delta.patch", patch)
    check_fails(
        repo, "--no-run", expect={(1, 4), (1, 8)}, message="the newest chapter has no delta"
    )


def test_i_include_of_a_missing_symbol_fails(repo: Path) -> None:
    edit(repo, "docs/ch00-a.md", "naive.py#greet", "naive.py#nosuch")
    check_fails(repo, "--no-run", expect={(0, 5)}, message="has no def or class 'nosuch'")

def test_count_markers_are_written_by_pages_and_checked(repo: Path) -> None:
    marked = ("naive.py：<!-- n: lines 0:naive.py -->9<!-- /n --> 行，"
              "<!-- n: tests 0:tests/ch00/test_a.py -->0<!-- /n --> 个测试。\n\n## 运行结果")
    edit(repo, "docs/ch00-a.md", "## 运行结果", marked)
    check_fails(repo, "--no-run", expect={(0, 5)}, message="a count marker is stale")
    assert steps_cmd(repo, "pages", "0").returncode == 0
    page = (repo / "docs/ch00-a.md").read_text(encoding="utf-8")
    assert "<!-- n: lines 0:naive.py -->3<!-- /n --> 行" in page  # NAIVE is 3 lines
    assert "<!-- n: tests 0:tests/ch00/test_a.py -->1<!-- /n --> 个测试" in page
    assert steps_cmd(repo, "check", "--no-run").returncode == 0


def test_code_markers_skip_comments_and_sum_folders_and_lists(repo: Path) -> None:
    # naive.py: 3 lines of code (the docstring counts) plus a comment and a blank line
    edit(repo, "chapters/ch00_a/naive.py", "def greet", "# a comment\n\ndef greet")
    steps_ok(repo, ["record", "0"])
    marked = ("<!-- n: code 0:naive.py -->9<!-- /n -->, "
              "<!-- n: nonblank 0:naive.py -->9<!-- /n -->, "
              "<!-- n: code 0:naive.py,naive.py -->9<!-- /n -->, "
              "<!-- n: code 0:minisgl -->9<!-- /n -->, "
              "<!-- n: code 0:minisgl/__init__.py,minisgl/util.py -->9<!-- /n -->"
              "\n\n## 运行结果")
    edit(repo, "docs/ch00-a.md", "## 运行结果", marked)
    steps_ok(repo, ["pages", "0"])
    page = (repo / "docs/ch00-a.md").read_text(encoding="utf-8")
    assert "<!-- n: code 0:naive.py -->3<!-- /n -->" in page
    assert "<!-- n: nonblank 0:naive.py -->4<!-- /n -->" in page
    assert "<!-- n: code 0:naive.py,naive.py -->6<!-- /n -->" in page
    folder = re.search(r"<!-- n: code 0:minisgl -->(\d+)<!-- /n -->", page)
    listed = re.search(r"<!-- n: code 0:minisgl/__init__.py,minisgl/util.py -->(\d+)<!-- /n",
                       page)
    assert folder and listed and folder[1] == listed[1] != "9"  # the folder: its two .py files
    assert steps_cmd(repo, "check", "--no-run").returncode == 0
    edit(repo, "docs/ch00-a.md", "code 0:naive.py,naive.py", "code 0:naive.py,nope.py")
    check_fails(repo, "--no-run", expect={(0, 5)}, message="tree 0 has no nope.py")


def test_a_cases_marker_counts_what_pytest_collects_and_is_checked_when_run(repo: Path) -> None:
    # tree 0's test file gains a test parametrized three ways: 2 functions, 4 cases
    param = "import pytest\n\n\n@pytest.mark.parametrize('n', [1, 2, 3])\ndef test_n(n):\n"
    edit(repo, "tests/ch00/test_a.py", "import naive\n", param + "    assert n\n\n\nimport naive\n")
    steps_ok(repo, ["record", "0"])
    marked = ("<!-- n: cases 0:tests/ch00 -->9<!-- /n --> 个测试（含参数化），"
              "<!-- n: tests 0:tests/ch00/test_a.py -->2<!-- /n --> 个测试函数。\n\n## 运行结果")
    edit(repo, "docs/ch00-a.md", "## 运行结果", marked)
    assert steps_cmd(repo, "check", "--no-run", "0").returncode == 0  # cases need pytest
    check_fails(repo, "0", expect={(0, 5)}, message="a count marker is stale")
    steps_ok(repo, ["pages", "0"])
    page = (repo / "docs/ch00-a.md").read_text(encoding="utf-8")
    assert "<!-- n: cases 0:tests/ch00 -->4<!-- /n --> 个测试（含参数化）" in page
    assert steps_cmd(repo, "check", "0").returncode == 0
    edit(repo, "docs/ch00-a.md", "cases 0:tests/ch00 -->", "cases 0:tests/ch99 -->")
    check_fails(repo, "0", expect={(0, 5)}, message="tree 0 has no tests/ch99")


def test_a_count_marker_naming_no_file_fails(repo: Path) -> None:
    edit(repo, "docs/ch00-a.md", "## 运行结果",
         "<!-- n: lines 0:nope.py -->1<!-- /n -->\n\n## 运行结果")
    check_fails(repo, "--no-run", expect={(0, 5)}, message="tree 0 has no nope.py")
    assert steps_cmd(repo, "pages", "0").returncode == 1  # pages says so too



@pytest.mark.parametrize(
    ("include", "message"),
    [
        ('"1:naive.py"', "a page of chapter 0 includes from tree 0"),
        ('"0:core.py"', "tree 0 has no core.py"),
        ('"0:naive.py:2:9"', "has 3 lines, not 2..9"),
        ('"repo:python/minisgl/util.py"', "include minisgl and test files from a tree"),
        ('"repo:examples/nothing.py"', "is not a file of the repository"),
    ],
)
def test_bad_includes_fail(repo: Path, include: str, message: str) -> None:
    edit(repo, "docs/ch00-a.md", '"0:naive.py#greet"', include)
    check_fails(repo, "--no-run", "0", expect={(0, 5)}, message=message)


# ---------------------------------------------------------------------------- commands


def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


def test_record_after_a_live_edit_keeps_the_older_trees(repo: Path, tmp_path: Path) -> None:
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "book")
    edit(repo, "python/minisgl/util.py", "return", "# chapter 1 polishes this\n    return")
    done = steps_cmd(repo, "record")
    assert done.returncode == 0, done.stderr
    assert "wrote chapters/ch00_a/delta.patch" in done.stdout and "tree 1: digest" in done.stdout
    assert "+++ tree01/minisgl/util.py" in (repo / "chapters/ch00_a/delta.patch").read_text()
    assert steps_cmd(repo, "build", "0", str(tmp_path / "t0")).returncode == 0
    assert (tmp_path / "t0/minisgl/util.py").read_text(encoding="utf-8") == UTIL
    assert steps_cmd(repo, "pages", "1").returncode == 0  # util.py is now [修改] in tree 1
    done = steps_cmd(repo, "check")
    assert done.returncode == 0, done.stdout


def test_record_fails_when_an_older_tree_is_lost(repo: Path) -> None:
    git(repo, "init", "-q")  # nothing committed: HEAD cannot give tree 0 back
    edit(repo, "python/minisgl/util.py", "return", "# never committed\n    return")
    done = steps_cmd(repo, "record")
    assert done.returncode == 2
    want = "tree 0 matches its recorded digest neither in the working copy nor at git HEAD"
    assert want in done.stderr


def test_record_n_dir_fixes_an_older_tree(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "t0"
    assert steps_cmd(repo, "build", "0", str(out)).returncode == 0
    edit(out, "minisgl/util.py", "return", "# a fix in tree 0 only\n    return")
    edit(out, "main.py", "print(", "# tree 0\nprint(")
    done = steps_cmd(repo, "record", "0", str(out))
    assert done.returncode == 0, done.stderr
    assert "wrote chapters/ch00_a/main.py" in done.stdout
    assert "# tree 0" in (repo / "chapters/ch00_a/main.py").read_text(encoding="utf-8")
    assert (repo / "python/minisgl/util.py").read_text(encoding="utf-8") == UTIL
    for n, fixed in ((0, True), (1, False)):
        assert steps_cmd(repo, "build", str(n), str(tmp_path / f"b{n}")).returncode == 0
        util = (tmp_path / f"b{n}/minisgl/util.py").read_text(encoding="utf-8")
        assert ("# a fix in tree 0 only" in util) == fixed
    assert steps_cmd(repo, "pages").returncode == 0
    done = steps_cmd(repo, "check", "--no-run")
    assert done.returncode == 0, done.stdout


def test_an_owned_file_close_to_its_successor_is_stored_as_its_delta(
    repo: Path, tmp_path: Path
) -> None:
    notes = "".join(f"# note {i}: the same in both chapters\n" for i in range(8))
    edit(repo, "chapters/ch01_b/main.py", "from", notes + "from")
    assert steps_cmd(repo, "record", "1").returncode == 0
    out = tmp_path / "t0"
    assert steps_cmd(repo, "build", "0", str(out)).returncode == 0
    main0 = notes + "print('tree 0')\n"
    (out / "main.py").write_text(main0, encoding="utf-8")
    done = steps_cmd(repo, "record", "0", str(out))
    assert done.returncode == 0, done.stderr
    assert "removed chapters/ch00_a/main.py (now stored in delta.patch)" in done.stdout
    patch = (repo / "chapters/ch00_a/delta.patch").read_text(encoding="utf-8")
    assert "--- tree00/main.py\n+++ tree01/main.py\n" in patch and "# note" not in patch
    assert steps_cmd(repo, "build", "0", str(tmp_path / "b0")).returncode == 0
    assert (tmp_path / "b0/main.py").read_text(encoding="utf-8") == main0
    assert steps_cmd(repo, "check", "--no-run").returncode == 0
    # a whole copy beside its section: stored twice
    write(repo, "chapters/ch00_a/main.py", main0)
    check_fails(repo, "--no-run", expect={(0, 1)}, message="also stored whole in chapters/ch00_a")
    (repo / "chapters/ch00_a/main.py").unlink()
    # tree 1's copy gone: it would inherit tree 0's, which is a delta against it
    (repo / "chapters/ch01_b/main.py").unlink()
    check_fails(
        repo, "--no-run", expect={(0, 1), (0, 5), (1, 1), (1, 5)}, message="derived from itself"
    )


def test_threads_resolving_one_book_do_not_take_each_other_for_a_cycle(template: Path) -> None:
    # `check --jobs 2` resolves one Book from two threads: a file one thread is making must not
    # look to the other like a file derived from itself
    import threading  # noqa: PLC0415

    from book.manifest import Book  # noqa: PLC0415

    book = Book(template)
    real = book._resolve
    book._resolve = lambda ch, path: (time.sleep(0.02), real(ch, path))[1]  # type: ignore[method-assign]
    errors: list[Exception] = []

    def build_all() -> None:
        try:
            for ch in book.chapters:
                book.tree(ch)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=build_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_owned_modes_inherit_then_delta_then_whole() -> None:
    from book.build import owned_modes  # noqa: PLC0415

    long = "".join(f"line {i}\n" for i in range(10)).encode()
    other = long.replace(b"line 3", b"LINE 3")
    trees = [{"main.py": long}, {"main.py": long}, {"main.py": other}, {"main.py": b"x\n"}]
    chapters = [type("C", (), {"number": n})() for n in range(4)]
    modes = owned_modes(chapters, trees)  # type: ignore[arg-type]
    # tree 1 equals tree 0: inherited; tree 0 cannot lean on it, so whole; tree 2 is far from
    # tree 3: whole; tree 3 is the newest: whole
    assert [modes[k, "main.py"] for k in range(4)] == ["whole", "inherit", "whole", "whole"]
    trees[3] = {"main.py": other + b"one more\n"}
    modes = owned_modes(chapters, trees)  # type: ignore[arg-type]
    assert [modes[k, "main.py"] for k in range(4)] == ["whole", "inherit", "delta", "whole"]


def test_record_n_records_a_chapter_edit_and_keeps_the_other_lines(repo: Path) -> None:
    edit(repo, "chapters/ch00_a/naive.py", "hello", "hi")
    check_fails(repo, "--no-run", expect={(0, 8)}, message="run `steps.py record 0`")
    before = (repo / "chapters/ch00_a/chapter.toml").read_text(encoding="utf-8")
    done = steps_cmd(repo, "record", "0")
    assert done.returncode == 0 and "tree 0: digest " in done.stdout
    assert steps_cmd(repo, "check", "--no-run").returncode == 0
    after = (repo / "chapters/ch00_a/chapter.toml").read_text(encoding="utf-8")
    changed = [(a, b) for a, b in zip(before.split("\n"), after.split("\n")) if a != b]
    assert len(changed) == 1 and changed[0][1].startswith('digest = "')
    assert after.startswith('title = "第 0 章"\npage = "docs/ch00-a.md"\ndigest = "')


def test_early_needs_a_difference_from_the_successor(repo: Path) -> None:
    edit(repo, "chapters/ch01_b/chapter.toml", "new = [", 'early = ["minisgl/core.py"]\nnew = [')
    check_fails(repo, "--no-run", "1", expect={(1, 5), (1, 8)}, message="early, but tree 1")


def test_tree_prints_the_marked_tree(repo: Path) -> None:
    done = steps_cmd(repo, "tree", "1")
    assert done.returncode == 0 and done.stdout == TREE1


def test_build_writes_exactly_the_tree(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert steps_cmd(repo, "build", "0", str(out)).returncode == 0
    files = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    written = sorted(p.relative_to(out).as_posix() for p in files)
    assert written == [
        "main.py",
        "minisgl/__init__.py",
        "minisgl/util.py",
        "naive.py",
        "tests/ch00/test_a.py",
    ]
    assert (out / "naive.py").read_text(encoding="utf-8") == NAIVE
    assert (out / "models").resolve() == (repo / "models").resolve()  # made if it was missing
    done = steps_cmd(repo, "build", "1", str(out))
    assert done.returncode == 2 and "not an empty folder" in done.stderr


def test_diff_shows_what_changed_since_the_previous_tree(repo: Path) -> None:
    done = steps_cmd(repo, "diff", "1")
    assert done.returncode == 0
    for header in (
        "--- a/main.py\n+++ b/main.py",
        "--- /dev/null\n+++ b/minisgl/core.py",
        "--- a/naive.py\n+++ /dev/null",
        "+++ b/tests/ch01/test_b.py",
    ):
        assert header in done.stdout
    assert "util.py" not in done.stdout and "+class Engine:" in done.stdout


def test_list_and_run(repo: Path) -> None:
    done = steps_cmd(repo, "list")
    assert done.stdout.splitlines() == [
        " 0  a                第 0 章  (5 files, docs/ch00-a.md)",
        " 1  b                第 1 章  (5 files, docs/ch01-b.md)",
    ]
    done = steps_cmd(repo, "run", "0", "--", "--ignored")
    assert done.returncode == 0 and done.stdout == "HELLO FROM CHAPTER 0\n"


def test_pages_is_idempotent(repo: Path) -> None:
    before = {p: p.read_bytes() for p in (repo / "docs").iterdir()}
    assert steps_cmd(repo, "pages").returncode == 0  # fresh timings and dates, same pages
    assert before == {p: p.read_bytes() for p in (repo / "docs").iterdir()}


def test_run_sees_models_and_passes_arguments(repo: Path) -> None:
    write(repo, "models/hello.txt", "weights\n")
    edit(
        repo,
        "chapters/ch00_a/main.py",
        "print(",
        "import sys\nprint(open('models/hello.txt').read().strip(), sys.argv[1:])\nprint(",
    )
    assert steps_cmd(repo, "record", "0").returncode == 0
    done = steps_cmd(repo, "run", "0", "--", "--flag")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "weights ['--flag']\nHELLO FROM CHAPTER 0\n"


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_timeout_kills_the_main_and_what_it_started(repo: Path, tmp_path: Path) -> None:
    # The child lets go of the pipes, so only killing the main's process group ends it.
    pidfile = tmp_path / "child.pid"
    hang = ("import subprocess, time\nchild = subprocess.Popen(['sleep', '600'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\ntime.sleep(600)\n")
    edit(repo, "chapters/ch00_a/main.py", "import naive\n", hang + "import naive\n")
    assert steps_cmd(repo, "record", "0").returncode == 0
    # The same timeout bounds the tree's pytest, which must pass: 6 s leaves a loaded CI room.
    out = check_fails(
        repo, "0", "--timeout", "6", expect={(0, 2), (0, 6)}, message="main.py timed out after 6 s"
    )
    assert "[3] tests pass             ok" in out
    child = int(pidfile.read_text())
    for _ in range(50):  # SIGKILL is sent; give the kernel a moment to deliver it
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), f"the main's child {child} outlived the timeout"


def test_mkdocs_hook_expands_includes(repo: Path) -> None:
    pytest.importorskip("mkdocs")
    shutil.copytree(TOOLS, repo / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    hooks = load_module("hooks_under_test", repo / "tools/mkdocs_hooks.py")
    page1 = (repo / "docs/ch01-b.md").read_text(encoding="utf-8")
    html = hooks.on_page_markdown(page1, page=None, config={}, files=None)
    assert "--8<--" not in html
    assert "```python\n@staticmethod\ndef run() -> None:\n    start = time" in html
    assert "```python\ndef demo():\n    return 1\n```" in html
    plain = "# 标题\n\n```python\nprint(1)\n```\n"
    assert hooks.on_page_markdown(plain, page=None, config={}, files=None) == plain
    with pytest.raises(Exception, match="has no def or class 'nosuch'"):
        hooks.on_page_markdown(page1.replace("#Engine.run", "#nosuch"), None, {}, None)


TEST0_MAKER = (
    "import subprocess\nimport sys\n\n"
    + TEST0
    + """

def test_the_model_maker_runs():  # what tests/conftest.py does when a model is missing
    cmd = [sys.executable, "tools/models.py"]
    assert subprocess.run(cmd, capture_output=True, text=True).stdout == "maker\\n"
"""
)


def test_build_gives_a_tree_a_reader_can_run(repo: Path, tmp_path: Path) -> None:
    # What a real chapter needs: its main loads models/..., its tests may run tools/models.py.
    write(repo, "models/hello.txt", "weights\n")
    write(repo, "tools/models.py", "print('maker')\n")
    edit(
        repo, "chapters/ch00_a/main.py", "print(", "print(open('models/hello.txt').read())\nprint("
    )
    write(repo, "tests/ch00/test_a.py", TEST0_MAKER)
    assert steps_cmd(repo, "record", "0").returncode == 0
    out = tmp_path / "reader"
    done = steps_cmd(repo, "build", "0", str(out))
    assert done.returncode == 0, done.stderr
    commands = [line.strip() for line in done.stdout.splitlines() if line.startswith("  ")]
    assert commands == [f"cd {out}", "python main.py", "python -m pytest -q tests"]
    env = {k: v for k, v in os.environ.items() if k not in ("MINISGL_REPO", "PYTHONPATH")}
    for cmd in (["main.py"], ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]):
        run = subprocess.run(
            [sys.executable, *cmd], cwd=out, env=env, capture_output=True, text=True, check=False
        )
        assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("..")  # both tests ran
    main = subprocess.run([sys.executable, "main.py"], cwd=out, capture_output=True, text=True)
    assert main.stdout == "weights\n\nHELLO FROM CHAPTER 0\n"


# ---------------------------------------------------------------------------- mutants

MUTANTS = """\
[[mutant]]
name = "lower"
about = "shout 变成小声：测试应当发现"
file = "minisgl/util.py"
find = "text.upper()"
replace = "text.lower()"

[[mutant]]
name = "quiet-timing"
about = "只改计时那一行的措辞：没有测试看它"
file = "minisgl/core.py"
find = "took {elapsed:.6f} ms at"
replace = "took {elapsed:.6f} ms on"
tests = ["tests/ch01/test_b.py::test_engine"]
expect = "survives"
"""


def with_mutants(repo: Path, text: str = MUTANTS) -> Path:
    write(repo, "chapters/ch01_b/mutants.toml", text)
    return repo


def test_mutate_lists_the_mutants(repo: Path) -> None:
    done = steps_cmd(with_mutants(repo), "mutate", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0].split() == ["lower", "shout", "变成小声：测试应当发现"]
    assert "quiet-timing" in done.stdout and steps_cmd(repo, "mutate", "0").returncode == 0


def test_a_killed_mutant_reports_the_failed_tests(repo: Path) -> None:
    done = steps_cmd(with_mutants(repo), "mutate", "1", "lower")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[:4] == [
        "mutant lower (chapter 1): shout 变成小声：测试应当发现",
        "file: minisgl/util.py",
        "--- a/minisgl/util.py",
        "+++ b/minisgl/util.py",
    ]
    assert "-    return text.upper()" in lines and "+    return text.lower()" in lines
    failed = [line for line in lines if line.startswith("FAILED")]
    assert len(failed) == 1, done.stdout
    assert failed[0].startswith("FAILED tests/ch01/test_b.py::test_engine - AssertionError: ")
    assert lines[-2:] == ["1 failed", "killed, as expected"]
    # The live files are untouched: only the temporary tree was mutated.
    assert (repo / "python/minisgl/util.py").read_text(encoding="utf-8") == UTIL


def test_a_surviving_mutant_is_reported(repo: Path) -> None:
    done = steps_cmd(with_mutants(repo), "mutate", "1", "quiet-timing")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-2:] == ["1 passed", "survived, as expected"]
    edit(repo, "chapters/ch01_b/mutants.toml", 'expect = "survives"\n', "")
    done = steps_cmd(repo, "mutate", "1", "quiet-timing")
    assert done.returncode == 1
    assert "the mutant survived: no test failed, but expect = 'killed'" in done.stdout


def test_a_mutant_whose_text_is_not_found_fails(repo: Path) -> None:
    with_mutants(repo, MUTANTS.replace('find = "text.upper()"', 'find = "text.title()"'))
    done = steps_cmd(repo, "mutate", "1", "lower")
    assert done.returncode == 2 and "`find` occurs 0 times in minisgl/util.py" in done.stderr
    check_fails(repo, "--no-run", "1", expect={(1, 3)}, message="`find` occurs 0 times")
    with_mutants(repo, MUTANTS.replace('name = "quiet-timing"', 'name = "Quiet"'))
    check_fails(repo, "--no-run", "1", expect={(1, 3)}, message="a name is made of a-z")
    with_mutants(repo, MUTANTS.replace("tests/ch01/test_b.py::", "tests/ch00/test_a.py::"))
    check_fails(repo, "--no-run", "1", expect={(1, 3)}, message="tree 1 has no tests/ch00/test_a")


def test_a_page_shows_a_mutant_report(repo: Path) -> None:
    with_mutants(repo)
    edit(
        repo,
        "docs/ch01-b.md",
        "<!-- output: demo -->",
        "<!-- output: mutant:lower -->\n\n<!-- output: demo -->",
    )
    assert steps_cmd(repo, "pages", "1").returncode == 0
    page = (repo / "docs/ch01-b.md").read_text(encoding="utf-8")
    assert "<!-- output: mutant:lower -->\n```text\nmutant lower (chapter 1)" in page
    assert "1 failed\nkilled, as expected\n```" in page
    done = steps_cmd(repo, "check", "1")
    assert done.returncode == 0, done.stdout
    edit(
        repo,
        "chapters/ch01_b/mutants.toml",
        'replace = "text.lower()"',
        'replace = "text.upper() "',
    )
    out = check_fails(repo, "1", expect={(1, 6)}, message="output 'mutant:lower' exited with 1")
    assert "the mutant survived" in out


# ---------------------------------------------------------------------------- benchmarks

BENCH = """\
import random
import sys
import time
from pathlib import Path

if "--quick" in sys.argv:
    print("smoke")
    sys.exit(int(Path("quick-fails").exists()))
Path("full-runs").open("a").write("ran\\n")  # the full run leaves a trace
print(f"speed: {random.randint(0, 10**9)} steps")  # never the same twice, and not masked
"""
BENCH_OUTPUT = (
    '\n[[output]]\nid = "speed"\ncmd = ["python", "examples/bench.py"]\nwhere = "repo"\n'
    'results = "benchmark/results/speed.txt"\n'
)


def with_benchmark(repo: Path) -> Path:
    write(repo, "examples/bench.py", BENCH)
    with (repo / "chapters/ch01_b/chapter.toml").open("a", encoding="utf-8") as f:
        f.write(BENCH_OUTPUT)
    with (repo / "docs/ch01-b.md").open("a", encoding="utf-8") as f:
        f.write("\n<!-- output: speed -->\n```text\n```\n")
    return repo


def test_a_benchmark_is_recorded_once_and_never_rerun_by_check(repo: Path) -> None:
    with_benchmark(repo)
    check_fails(repo, "--no-run", "1", expect={(1, 6)}, message="run `steps.py bench 1 speed`")
    done = steps_cmd(repo, "bench", "1", "speed")
    assert done.returncode == 0, done.stderr
    header, body = (repo / "benchmark/results/speed.txt").read_text(encoding="utf-8").split("\n", 1)
    assert header.startswith("# python examples/bench.py · ") and "logical CPUs · 20" in header
    assert re.fullmatch(r"speed: \d+ steps\n", body)
    assert steps_cmd(repo, "pages", "1").returncode == 0
    assert f"<!-- output: speed -->\n```text\n{body}```" in (repo / "docs/ch01-b.md").read_text()
    done = steps_cmd(repo, "check", "1")
    assert done.returncode == 0, done.stdout
    assert (repo / "full-runs").read_text() == "ran\n"  # bench ran it; check did not


def test_a_benchmark_block_must_equal_its_results_file(repo: Path) -> None:
    with_benchmark(repo)
    assert steps_cmd(repo, "bench", "1", "speed").returncode == 0
    assert steps_cmd(repo, "pages", "1").returncode == 0
    edit(repo, "benchmark/results/speed.txt", "speed: ", "speed: 1")
    check_fails(repo, "--no-run", "1", expect={(1, 6)}, message="differs from benchmark/results")


def test_a_benchmark_whose_quick_run_fails_fails(repo: Path) -> None:
    with_benchmark(repo)
    assert steps_cmd(repo, "bench", "1", "speed").returncode == 0
    assert steps_cmd(repo, "pages", "1").returncode == 0
    write(repo, "quick-fails", "")
    check_fails(repo, "1", expect={(1, 6)}, message="output 'speed' --quick exited with 1")


# ---------------------------------------------------------------------------- other pages, sizes

APPENDIX = """\
# 附录

<!-- output: 1:demo -->

<!-- output: 0:main -->
```text
stale
```
"""


def test_a_page_outside_the_chapters_shows_chapter_outputs(repo: Path) -> None:
    write(repo, "docs/appendix-x.md", APPENDIX)
    assert steps_cmd(repo, "pages", "1").returncode == 0  # fills 1:demo, leaves 0:main alone
    text = (repo / "docs/appendix-x.md").read_text(encoding="utf-8")
    assert "<!-- output: 1:demo -->\n```text\nrepo ok\n```" in text and "stale" in text
    check_fails(repo, "0", expect={(0, 6)}, message="docs/appendix-x.md:8: output 'main' no longer")
    assert steps_cmd(repo, "pages", "0").returncode == 0
    assert steps_cmd(repo, "check").returncode == 0
    edit(repo, "docs/appendix-x.md", "1:demo", "demo")
    out = check_fails(repo, "--no-run", expect=set(), message="output 'demo' names no chapter")
    assert "summary: 9 ok, 1 failed, 6 skipped" in out


def test_check_prints_page_sizes_and_flags_big_pages(repo: Path) -> None:
    write(repo, "docs/appendix-big.md", "# 大\n\n" + "字" * 16_000 + "\n")
    done = steps_cmd(repo, "check", "--no-run")
    assert done.returncode == 0, done.stdout
    tail = done.stdout.split("pages (a warning above")[1].splitlines()[1:-1]
    sizes = {line.split()[0]: line.split()[1:] for line in tail if " KB" in line}
    assert sizes["docs/appendix-big.md"] == ["46.9", "KB", "warning:", "over", "45", "KB"]
    assert sizes["docs/ch00-a.md"][1:] == ["KB"] and sizes["docs/ch01-b.md"][1:] == ["KB"]
    assert done.stdout.endswith("0 failed, 6 skipped, 1 warning\n")


def test_a_manifest_may_have_no_outputs(repo: Path) -> None:
    text = (repo / "chapters/ch01_b/chapter.toml").read_text(encoding="utf-8")
    write(repo, "chapters/ch01_b/chapter.toml", text.split("\n[[output]]")[0])
    done = steps_cmd(repo, "list")
    assert done.returncode == 0, done.stderr
    check_fails(repo, "--no-run", "1", expect={(1, 6)}, message="chapter 1 has no output 'main'")


# ---------------------------------------------------------------------------- a file that moves

LONG_UTIL = UTIL + "".join(
    f"\n\ndef helper_{i}(x: int) -> int:\n    return x + {i}\n" for i in range(8)
)
TEXT = LONG_UTIL.replace(
    "def shout(", '"""Text helpers: util.py until chapter 1."""\n\n\ndef shout('
)


def test_record_all_takes_an_edit_of_a_shared_file_into_every_tree(
    repo: Path, tmp_path: Path
) -> None:
    # minisgl/util.py is in both trees; an edit of its live copy reaches tree 0 as well
    edit(repo, "python/minisgl/util.py", "def ", "# shared by both trees\ndef ")
    check_fails(repo, "--no-run", expect={(0, 8), (1, 8)}, message="tree 0 changed")
    steps_ok(repo, ["record", "--all"], ["pages"])
    assert steps_cmd(repo, "check", "--no-run").returncode == 0
    steps_ok(repo, ["build", "0", str(tmp_path / "t0")])
    assert "# shared by both trees" in (tmp_path / "t0/minisgl/util.py").read_text("utf-8")
    assert not (repo / "chapters/ch00_a/delta.patch").exists() or "util.py" not in (
        repo / "chapters/ch00_a/delta.patch"
    ).read_text("utf-8")
    done = steps_cmd(repo, "record", "--all", "0")
    assert done.returncode != 0 and "takes no N or DIR" in done.stderr


def test_record_all_refuses_a_tree_whose_delta_no_longer_fits(repo: Path, tmp_path: Path) -> None:
    # tree 0 has its own util.py (a delta); a live edit that moves its lines makes the reverse
    # hunk replace the wrong line, and the tree it gives does not parse
    steps_ok(repo, ["build", "0", str(tmp_path / "t0")])
    edit(tmp_path / "t0", "minisgl/util.py", "upper", "lower")
    steps_ok(repo, ["record", "0", str(tmp_path / "t0")])
    edit(repo, "python/minisgl/util.py", "def ", "import os\n\n\ndef ")
    before = {p: p.read_bytes() for p in (repo / "chapters").rglob("*") if p.is_file()}
    done = steps_cmd(repo, "record", "--all")
    assert done.returncode != 0, done.stdout
    assert "tree 0's minisgl/util.py would not parse" in done.stderr, done.stderr
    assert {p: p.read_bytes() for p in (repo / "chapters").rglob("*") if p.is_file()} == before


def moved_book(repo: Path) -> Path:
    """The book with a longer minisgl/util.py in both trees, committed; then chapter 1 moves it
    to minisgl/text.py with a docstring added, and `record` stores that."""
    write(repo, "python/minisgl/util.py", LONG_UTIL)
    for folder in ("ch00_a", "ch01_b"):  # both trees are what they materialise to now
        toml = repo / "chapters" / folder / "chapter.toml"
        text = toml.read_text(encoding="utf-8")
        toml.write_text(re.sub(r"digest = .*\n", "", text), encoding="utf-8")
    assert steps_cmd(repo, "record").returncode == 0
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "book")
    (repo / "python/minisgl/util.py").unlink()
    write(repo, "python/minisgl/text.py", TEXT)
    edit(repo, "python/minisgl/core.py", "minisgl.util", "minisgl.text")
    edit(repo, "chapters/ch01_b/chapter.toml", "new = [\n", 'new = [\n  "minisgl/text.py",\n')
    edit(repo, "chapters/ch01_b/chapter.toml", "gone = [\n", 'gone = [\n  "minisgl/util.py",\n')
    done = steps_cmd(repo, "record")
    assert done.returncode == 0, done.stdout + done.stderr
    assert steps_cmd(repo, "pages").returncode == 0
    return repo


def test_record_stores_a_moved_file_as_a_rename(repo: Path, tmp_path: Path) -> None:
    moved_book(repo)
    patch = (repo / "chapters/ch00_a/delta.patch").read_text(encoding="utf-8")
    assert patch == (
        "rename from minisgl/util.py\n"
        "rename to minisgl/text.py\n"
        "--- tree00/minisgl/util.py\n"
        "+++ tree01/minisgl/text.py\n"
        "@@ -0,0 +1,3 @@\n"  # tree 0 lacks text.py's first three lines
    )
    assert len(patch.splitlines()) < len(LONG_UTIL.splitlines())  # shorter than the file whole
    assert steps_cmd(repo, "build", "0", str(tmp_path / "t0")).returncode == 0
    assert (tmp_path / "t0/minisgl/util.py").read_text(encoding="utf-8") == LONG_UTIL
    assert not (tmp_path / "t0/minisgl/text.py").exists()
    assert "text.py        [新建]" in steps_cmd(repo, "tree", "1").stdout
    done = steps_cmd(repo, "check")
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(
    ("old", "new", "expect", "message"),
    [
        # inside the hunk's range: tree 0 comes back as recorded
        ("until chapter 1", "until the first chapter", {(1, 8)}, "tree 1 changed"),
        # a line more in that range: tree 0 keeps a blank line that is not its own
        ("until chapter 1.", "until chapter 1,\nwhere it moved.", {(0, 8), (1, 8)}, STALE_DELTA_0),
        # the file got shorter than the hunk's range
        (
            TEXT,
            '"""Text."""\n\n',
            {(0, 1), (1, 8)},
            "hunk 1 (@@ -0,0 +1,3 @@) does not fit tree01/minisgl/text.py: it replaces lines 1 to "
            "3, but the successor has 2 lines",
        ),
    ],
    ids=["inside-the-range", "lines-moved", "successor-shorter"],
)
def test_a_moved_file_edited_without_record_fails(
    repo: Path, old: str, new: str, expect: set[tuple[int, int]], message: str
) -> None:
    # The rename's successor, the file at its new path, changes and nobody runs `record`.
    moved_book(repo)
    edit(repo, "python/minisgl/text.py", old, new)
    check_fails(repo, "--no-run", expect=expect, message=message)


def test_a_moved_file_edited_far_from_its_hunks_leaks_into_the_older_tree(repo: Path) -> None:
    moved_book(repo)
    edit(repo, "python/minisgl/text.py", "return x + 7", "return x + 70")
    message = "tree 0 changed: if chapter 0 meant it, run `steps.py record 0`"
    check_fails(repo, "--no-run", expect={(0, 8), (1, 8)}, message=message)


def move_again(repo: Path) -> None:
    """The file moves on (text.py -> words.py) and the manifest follows."""
    (repo / "python/minisgl/text.py").rename(repo / "python/minisgl/words.py")
    edit(repo, "python/minisgl/core.py", "minisgl.text", "minisgl.words")
    edit(repo, "chapters/ch01_b/chapter.toml", '"minisgl/text.py"', '"minisgl/words.py"')


def keep_the_old_path(repo: Path) -> None:
    """Tree 1 holds util.py again, beside text.py."""
    write(repo, "python/minisgl/util.py", LONG_UTIL)
    edit(repo, "chapters/ch01_b/chapter.toml", '  "minisgl/util.py",\n', "")


def add_the_new_path_earlier(repo: Path) -> None:
    """text.py enters the book in chapter 0 instead of chapter 1."""
    edit(repo, "chapters/ch01_b/chapter.toml", '  "minisgl/text.py",\n', "")
    edit(repo, "chapters/ch00_a/chapter.toml", "new = [\n", 'new = [\n  "minisgl/text.py",\n')


@pytest.mark.parametrize(
    ("change", "expect", "message"),
    [
        (move_again, {(0, 1), (1, 5), (1, 8)}, "but tree 1 has no minisgl/text.py"),
        (keep_the_old_path, {(0, 1), (1, 5), (1, 8)}, "but tree 1 still holds minisgl/util.py"),
        (
            add_the_new_path_earlier,
            {(0, 1), (0, 5), (1, 5)},
            "but tree 0 holds minisgl/text.py too",
        ),
    ],
)
def test_a_rename_that_no_longer_fits_the_manifests_fails(
    repo: Path, change, expect: set[tuple[int, int]], message: str
) -> None:
    # The trees' file lists change and nobody runs `record`: the rename is refused, not guessed.
    moved_book(repo)
    change(repo)
    message = "chapters/ch00_a/delta.patch: minisgl/util.py: renamed to minisgl/text.py, " + message
    check_fails(repo, "--no-run", expect=expect, message=message)
    if change is add_the_new_path_earlier:
        return  # tree 0 itself changed: that needs `record 0 DIR`, from a tree built at HEAD
    done = steps_cmd(repo, "record")  # tree 1 changed: recording it re-derives the rename
    assert done.returncode == 0, done.stdout + done.stderr
    patch = repo / "chapters/ch00_a/delta.patch"
    if change is move_again:
        assert "rename to minisgl/words.py\n" in patch.read_text(encoding="utf-8")
    else:
        assert not patch.exists()  # tree 0's util.py is tree 1's, unchanged
    assert steps_cmd(repo, "pages").returncode == 0
    done = steps_cmd(repo, "check", "--no-run")
    assert done.returncode == 0, done.stdout


def test_early_needs_a_difference_from_the_file_it_moved_to(repo: Path) -> None:
    moved_book(repo)
    toml = "chapters/ch00_a/chapter.toml"
    edit(repo, toml, "new = [", 'early = ["minisgl/util.py"]\nnew = [')
    assert steps_cmd(repo, "pages", "0").returncode == 0
    assert steps_cmd(repo, "check", "--no-run").returncode == 0  # the docstring differs
    write(repo, "python/minisgl/text.py", LONG_UTIL)  # now it moves unchanged
    assert steps_cmd(repo, "record").returncode == 0
    patch = (repo / "chapters/ch00_a/delta.patch").read_text(encoding="utf-8")
    assert patch.endswith("+++ tree01/minisgl/text.py\n")  # a rename without hunks
    check_fails(repo, "--no-run", expect={(0, 8)}, message="early, but tree 0's copy equals")


# ---------------------------------------------------------------------------- the package index


def index_rows(root: Path) -> dict[str, tuple[str, str]]:
    """`name` -> (introduced, changed) cells of docs/appendix-index.md."""
    rows = {}
    for line in (root / "docs/appendix-index.md").read_text(encoding="utf-8").splitlines():
        if m := re.fullmatch(r"\| `([\w.]+)` \| (.*?) \| (.*?) \|", line):
            rows[m[1]] = (m[2], m[3])
    return rows


def test_index_lists_each_definition_with_its_chapters(repo: Path) -> None:
    rows = index_rows(repo)
    assert rows == {
        "Engine": ("[1](ch01-b.md)", "—"),
        "Engine.run": ("[1](ch01-b.md)", "—"),
        "shout": ("[0](ch00-a.md)", "—"),
    }
    text = (repo / "docs/appendix-index.md").read_text(encoding="utf-8")
    assert "## `minisgl/core.py`" in text and "## `minisgl/util.py`" in text


def test_index_records_a_change_but_not_a_docstring(repo: Path) -> None:
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "book")
    edit(repo, "python/minisgl/util.py", "    return", '    """Loud."""\n    return')
    steps_ok(repo, ["record"], ["pages", "--index"])
    assert index_rows(repo)["shout"] == ("[0](ch00-a.md)", "—")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a docstring")
    edit(repo, "python/minisgl/util.py", "text.upper()", "text.upper() + '!'")
    steps_ok(repo, ["record"], ["pages", "--index"])
    assert index_rows(repo)["shout"] == ("[0](ch00-a.md)", "[1](ch01-b.md)")


def test_index_skips_private_names_but_keeps_dunders() -> None:
    from book.index import symbols

    source = (
        "def _helper(): pass\n"
        "class A:\n"
        "    def __init__(self): pass\n"
        "    def _private(self): pass\n"
        "    def public(self): pass\n"
        "class _Hidden:\n"
        "    def run(self): pass\n"
    )
    assert list(symbols(source)) == ["A", "A.__init__", "A.public"]
    changed = source.replace("def _private(self): pass", "def _private(self): return 1")
    assert symbols(changed)["A"] != symbols(source)["A"]  # a private method belongs to its class
    assert symbols(changed)["A.public"] == symbols(source)["A.public"]


def test_a_stale_index_fails_the_check_until_regenerated(repo: Path) -> None:
    edit(repo, "docs/appendix-index.md", "| `shout` |", "| `whisper` |")
    done = steps_cmd(repo, "check", "--no-run")
    assert done.returncode == 1, done.stdout + done.stderr
    assert failures(done.stdout) == set(), done.stdout
    assert "docs/appendix-index.md is stale" in done.stdout
    assert "run `steps.py pages --index`" in done.stdout
    done = steps_cmd(repo, "pages", "--index")
    assert done.returncode == 0, done.stdout + done.stderr
    done = steps_cmd(repo, "check", "--no-run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the package index matches the trees" in done.stdout


def test_a_second_writing_command_is_refused_while_one_runs(repo: Path) -> None:
    """Two `pages` at once interleave their writes; the second is refused and names the first."""
    steps = load_module("steps_for_lock", STEPS)
    page = (repo / "docs/ch00-a.md").read_text(encoding="utf-8")
    with steps.one_writer(repo, "pages"):
        for command in ("pages", "record"):
            done = steps_cmd(repo, command)
            assert done.returncode == 2 and "another `steps.py pages/bench/record`" in done.stderr
        assert steps_cmd(repo, "check", "--no-run").returncode == 0  # readers are not held up
    assert (repo / "docs/ch00-a.md").read_text(encoding="utf-8") == page
    steps_ok(repo, ["pages"])
