"""Make chapter 0's naive engine importable when the tests run on the repo (chapter 0)."""

import sys
from pathlib import Path

# In a materialised chapter tree `naive.py` sits at the root, already importable; on the repo it
# lives in chapters/ch00_naive/. This path does not exist inside a tree, so nothing leaks in.
_CH00 = Path(__file__).resolve().parents[2] / "chapters" / "ch00_naive"
if _CH00.is_dir():
    sys.path.insert(0, str(_CH00))
