"""Chapter 21: the finished package, module by module, imports on a machine without a GPU and
without the optional GPU packages (FlashInfer, sgl-kernel): what needs them loads lazily."""

from __future__ import annotations

import importlib
import pkgutil

import minisgl


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(minisgl.__path__, "minisgl.")]
    assert len(names) > 60
    for name in names:
        importlib.import_module(name)
    assert {"minisgl.attention.fi", "minisgl.kernel.fused_moe", "minisgl.server.launch"} <= \
        set(names)
