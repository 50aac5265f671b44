"""How many PTX instructions each of our kernels compiles to, for sm_90, in two versions of
csrc/ (an older one and this tree's): a count of the source's straight-line work that needs nvcc
but no GPU. It is the static count of each kernel's body (both branches of every `if`, loops
unrolled as nvcc unrolls them), not the instructions a thread executes, and not time: a GPU's
timing is benchmark/qk_kernel.py's.

    git archive REV python/minisgl/kernel/csrc | tar -x -C /tmp/old   # the older sources
    python benchmark/ptx_count.py /tmp/old/python/minisgl/kernel/csrc"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
from minisgl.kernel import cuda  # noqa: E402

ENTRY = re.compile(r"^\.(?:visible )?\.?entry (\S+)\(")
NAME = re.compile(r"\d+([a-z_]+_kernel)(?:(I.*?EE)v|E)")  # the name, its template arguments
ARGS = [(r"NS_4PackIjLi4EEE", "Pack<u32;4>,"), (r"NS_4bf16E", "bf16,"), (r"Lb1E", "residual,"),
        (r"Lb0E", ""), (r"Li(\d+)E", r"\1,"), (r"^f", "float,"), (r"j", "u32,"), (r"i$", "int32"),
        (r"l$", "int64")]


def count(csrc: Path, arch: str = "sm_90") -> Counter[str]:
    """Instructions per kernel instantiation of csrc/kernels.cu compiled to PTX for `arch`."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernels.ptx"
        cmd = cuda.build_command(False, csrc / "kernels.cu", ptx, arch=arch)
        cmd = [a for a in cmd if a not in ("-shared", "-Xcompiler", "-fPIC")] + ["-ptx"]
        subprocess.run(cmd, check=True)
        counts: Counter[str] = Counter()
        entry = None
        for line in ptx.read_text().splitlines():
            if m := ENTRY.match(line):
                entry = readable(m.group(1))
            elif entry and line.startswith("\t") and (line[1:2].isalpha() or line[1:2] == "@"):
                counts[entry] += 1  # an instruction (or a predicated one), not a directive
        return counts


def readable(mangled: str) -> str:
    """qk_norm_rope_kernel<bf16, 8, int32> from the mangled name: the same in every build (the
    mangled one carries a hash of the source's path)."""
    m = NAME.search(mangled)
    if not m:
        return mangled
    args = (m.group(2) or "")[1:-2]
    for pattern, repl in ARGS:
        args = re.sub(pattern, repl, args)
    args = args.strip(",").replace(",", ", ").replace(";", ", ")
    return f"{m.group(1)}<{args}>" if args else m.group(1)


def main() -> None:
    old, new = count(Path(sys.argv[1])), count(cuda.CSRC)
    print(f"PTX instructions per kernel, sm_90, nvcc -O3 -fmad=false: old ({sys.argv[1]}) "
          "and this tree's")
    for name in sorted(new):
        print(f"  {name:<44} {old.get(name, 0):>6} {new[name]:>6} "
              f"{old.get(name, 0) / new[name]:5.2f}x")


if __name__ == "__main__":
    main()
