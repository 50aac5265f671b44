#!/usr/bin/env bash
# Creates the virtual environment and installs the pinned dependencies; `make` runs it once per
# change of constraints.txt or pyproject.toml. Where no CUDA GPU is found, torch comes from the
# CPU wheel index ($TORCH_INDEX), so no multi-GB CUDA wheels are downloaded.
set -euo pipefail
venv=${VENV:-.venv}
torch_index=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
torch_pin=$(grep '^torch==' constraints.txt)

if ! command -v nvidia-smi >/dev/null && ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "install: no CUDA GPU here, so the CPU build of $torch_pin (from $torch_index)"
    # torch alone (its dependencies come pinned below, from the default index). A machine that
    # cannot reach that index gives up within seconds and falls back to the default index.
    $pip install --quiet --no-deps --timeout 5 --retries 0 --index-url "$torch_index" "$torch_pin" ||
        echo "install: $torch_index not reachable; torch comes from the default index instead"
fi
echo "install: the pinned packages of constraints.txt (a few minutes the first time)"
$pip install --quiet -c constraints.txt -e '.[dev,docs]'
