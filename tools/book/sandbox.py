"""Isolated runs: a command inside a materialised tree that imports only the tree (chapter 0).

A sitecustomize.py put first on the path guards the imports and logs every file of the tree the
process opens (property 7).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from book.build import link_models, write_tree
from book.manifest import Book, Chapter

SITECUSTOMIZE = '''\
"""Written by tools/steps.py: keep the tree's modules inside the tree; log what gets imported."""
import atexit
import importlib.machinery
import os
import sys

TREE = {tree!r}
GUARDED = {guarded!r}


class TreeOnlyFinder:
    """Finds the tree's top-level modules (and their submodules) only inside the tree."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in GUARDED:
            return None
        where = [TREE] if path is None else [
            p for p in path if os.path.realpath(p).startswith(TREE + os.sep)]
        spec = importlib.machinery.PathFinder.find_spec(fullname, where)
        if spec is None:
            raise ModuleNotFoundError(
                f"{{fullname}} is not in this chapter's tree ({{TREE}}): add the file to the "
                "`new` list of the chapter's chapter.toml, or do without it", name=fullname)
        return spec


_OPENED = set()  # set() rather than a literal: this text goes through str.format
LOG = os.environ.get("MINISGL_STEPS_LOG")


def _audit(event, args):
    """Every file of the tree this process opens (imports included), logged as it happens:
    pytest may drop a module from sys.modules (two conftest.py files do that), and a child of a
    fork server leaves through os._exit, which runs no exit hook."""
    if event == "open" and args and isinstance(args[0], str):
        real = os.path.realpath(args[0])
        if real.startswith(TREE + os.sep):
            name = real[len(TREE) + 1:]
            if name not in _OPENED:
                _OPENED.add(name)
                if LOG and not name.startswith(".steps/"):
                    with open(LOG, "a", encoding="utf-8") as stream:
                        stream.write(name + "\\n")


def _log_imports():
    """At exit, the modules this process holds without having opened them (inherited from the
    process it was forked from)."""
    if not LOG:
        return
    used = set()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        real = os.path.realpath(file) if isinstance(file, str) else ""
        if real.startswith(TREE + os.sep) and not real.startswith(TREE + "/.steps/"):
            used.add(real[len(TREE) + 1:])
    with open(LOG, "a", encoding="utf-8") as stream:
        stream.write("".join(name + "\\n" for name in sorted(used - _OPENED)))


sys.meta_path.insert(0, TreeOnlyFinder)
sys.addaudithook(_audit)
atexit.register(_log_imports)
'''


@dataclass
class RunResult:
    returncode: int | None  # None when the command timed out
    stdout: str
    stderr: str

    def failure(self, what: str, timeout: float) -> str | None:
        """None when the run succeeded, else a message with the end of its output."""
        if self.returncode == 0:
            return None
        if self.returncode is None:
            head = f"{what} timed out after {timeout:g} s"
        else:
            head = f"{what} exited with {self.returncode}"
        tail = "\n".join((self.stdout + "\n" + self.stderr).strip().split("\n")[-25:])
        return f"{head}:\n{tail}"


@contextlib.contextmanager
def sandbox(book: Book, ch: Chapter) -> Iterator[Path]:
    """A temporary folder holding tree N, models/ linked, and the isolation machinery."""
    with tempfile.TemporaryDirectory(prefix=f"steps-ch{ch.number:02d}-") as tmp:
        box = Path(tmp)
        write_tree(book, ch, box)
        link_models(book, box, with_maker=False)  # MINISGL_REPO tells tests where tools/ is
        guarded = {"minisgl"} | {f.path.split("/")[0].removesuffix(".py") for f in ch.files}
        (box / ".steps").mkdir()
        text = SITECUSTOMIZE.format(tree=os.path.realpath(box), guarded=sorted(guarded))
        (box / ".steps" / "sitecustomize.py").write_text(text, encoding="utf-8")
        yield box


def run_command(
    book: Book,
    cmd: list[str],
    cwd: Path,
    timeout: float,
    *,
    isolated: bool,
    log: str = "imports.log",
    capture: bool = True,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Run `cmd` (argv[0] "python" = this interpreter) in the sandbox `cwd` when `isolated`,
    else at `cwd` with PYTHONPATH=python; `log` names the sandbox's import log, `env` adds
    variables."""
    env = dict(os.environ, **(env or {}), MINISGL_REPO=str(book.root), PYTHONDONTWRITEBYTECODE="1")
    env.pop("MINISGL_STEPS_LOG", None)
    # pytest stops shortening assertion explanations when it sees a CI system (CI or
    # BUILD_NUMBER set), which changes a mutant report's summary line: a run's output must not
    # depend on where it runs.
    for var in ("CI", "BUILD_NUMBER"):
        env.pop(var, None)
    if isolated:
        env["PYTHONPATH"] = f"{cwd / '.steps'}{os.pathsep}{cwd}"
        env["MINISGL_STEPS_LOG"] = str(cwd / ".steps" / log)
    else:
        env["PYTHONPATH"] = str(book.root / "python")
    argv = [sys.executable if i == 0 and a == "python" else a for i, a in enumerate(cmd)]
    pipe = subprocess.PIPE if capture else None
    # A captured command gets its own process group, so that whatever it starts (servers,
    # workers) is killed with it; an interactive one (`run N`) stays in the terminal's group.
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=capture
    )
    returncode: int | None = None
    try:
        out, err = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        if capture:  # the whole group: a child holding the pipes would block communicate()
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        out, err = proc.communicate()
    finally:
        if capture:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return RunResult(returncode, out or "", err or "")
