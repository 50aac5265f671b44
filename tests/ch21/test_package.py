"""Chapter 21: the finished package, module by module, imports on a machine without a GPU and
without the optional GPU packages (FlashInfer, sgl-kernel): what needs them loads lazily. And
its imports go one way, down the layers, with no circle."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import minisgl


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(minisgl.__path__, "minisgl.")]
    assert len(names) > 60
    for name in names:
        importlib.import_module(name)
    assert {"minisgl.attention.fi", "minisgl.kernel.fused_moe", "minisgl.server.launch"} <= \
        set(names)


# The package's layers, bottom first: a module may import (at run time: at module level or
# inside a function) only from its own package and from the layers below. Imports under
# `if TYPE_CHECKING:` are for annotations and may point anywhere.
LAYERS = (
    ("utils",),
    ("core", "model_config"),
    ("message", "distributed", "kernel"),
    ("layers", "kvcache", "attention", "moe"),
    ("models",),
    ("engine",),
    ("scheduler", "tokenizer"),
    ("llm", "server", "__main__"),
)
ROOT = Path(minisgl.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> Iterator[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every `minisgl` import in the file that
    runs when the file or one of its functions runs: all but those under TYPE_CHECKING."""
    name, package = _module(path), path.name == "__init__.py"

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".")[: len(name.split(".")) - node.level + package]
        return ".".join(base + ([node.module] if node.module else []))

    def walk(nodes: list[ast.stmt], top: bool) -> Iterator[tuple[str, bool, int]]:
        for n in nodes:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                yield from walk(n.orelse, top)
                continue
            if isinstance(n, ast.Import):
                yield from ((a.name, top, n.lineno) for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = absolute(n)
                for a in n.names:  # `from pkg import module` imports the module
                    full = f"{base}.{a.name}"
                    yield (full if _exists(full) else base), top, n.lineno
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(n, field, None)
                if isinstance(inner, list) and inner:
                    function = isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    yield from walk(inner, top and not function)  # type: ignore[arg-type]

    yield from ((m, top, line) for m, top, line in walk(ast.parse(path.read_text()).body, True)
                if m.split(".")[0] == "minisgl")


def _exists(module: str) -> bool:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def test_imports_go_down_the_layers_and_never_in_a_circle() -> None:
    files = sorted(ROOT.rglob("*.py"))
    upward, graph = [], {}
    for path in files:
        here = _module(path)
        if here == "minisgl":
            continue
        graph[here] = set()
        for target, _, line in runtime_imports(path):
            if target == "minisgl":
                continue
            same = target.split(".")[1] == here.split(".")[1]
            if not same and _layer(target) > _layer(here):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
            graph[here].add(target)
    assert not upward, "upward imports:\n" + "\n".join(upward)
    circle = import_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle or [])
    assert len(graph) > 60


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A module reached again from itself, through run-time imports (a lazy one, inside a
    function, counts too: it still ties the two modules together), or None."""
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return trail + [m, n]
            if n not in state and (found := visit(n, trail + [m])) is not None:
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])) is not None:
            return found
    return None


def test_the_import_check_sees_what_it_must(tmp_path: Path) -> None:
    """The reader above on planted files: a lazy import counts, a TYPE_CHECKING one does not,
    relative imports resolve."""
    pkg = ROOT / "kvcache" / "__init__.py"
    found = {m for m, _, _ in runtime_imports(pkg)}
    assert "minisgl.kvcache.radix_cache" in found  # lazy, inside a function
    assert "minisgl.model_config" in found
    core = {m for m, _, _ in runtime_imports(ROOT / "core.py")}
    assert "minisgl.attention" not in core  # only under TYPE_CHECKING there
    assert _layer("minisgl.models.base") > _layer("minisgl.attention.fi")
    # a circle is found and named from where it starts; a diamond is no circle
    assert import_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
