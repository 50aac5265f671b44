# The reader's commands: `make quickstart` shows the main result, `make test` runs what CI runs.
# Both set up .venv first (once per change of constraints.txt / pyproject.toml) and are idempotent.
# `make test` keeps two processes of tests and two chapters of `steps.py check` going at once:
# most of their work is in subprocesses, and the CI machine has two cores. OMP_WAIT_POLICY=PASSIVE:
# torch's OpenMP threads sleep instead of spinning while they wait, so two processes that each
# use every core do not spin against each other (measured: tests/ch18 twice at once, 26 -> 20 s).
# PYTEST_ADDOPTS: three pytest plugins that installed packages register and no test uses
# (test_ch15_schema.py calls schemathesis itself); loading them costs each of the run's dozens
# of pytest processes about a second of CPU (measured on one trivial test: 2.5 -> 1.3 s).
# MINISGL_REFERENCE_CACHE: a folder for this run only, where HF's greedy answers are kept for
# the run's other processes (tests/reference.py): the live tests, the trees' tests and mains
# ask HF the same questions.
# TORCH_INDEX=<url> picks another wheel index for torch on machines without a CUDA GPU.
# The newest chapter's tests run once, in `steps.py check`: its tree is the package itself
# (property 4), so running them here as well would check the same code twice.
NEWEST_TESTS := $(wildcard tests/ch$(shell ls chapters | tail -1 | cut -c3-4))
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
STAMP := $(VENV)/.installed-$(shell cat constraints.txt pyproject.toml | sha256sum | cut -c1-12)

.PHONY: quickstart test docs clean

quickstart: $(STAMP)
	$(PY) tools/models.py smollm2
	$(PY) examples/ch00_quickstart.py

test: export OMP_WAIT_POLICY ?= PASSIVE
test: export PYTEST_ADDOPTS ?= -p no:schemathesis -p no:anyio -p no:platformdirs
test: $(STAMP)
	$(PY) tools/models.py tiny
	$(PY) tools/models.py smollm2
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && export MINISGL_REFERENCE_CACHE=$$cache && \
	ruff check . && mypy && time python -m pytest -q -n 2 --durations=10 $(NEWEST_TESTS:%=--ignore=%) && time python tools/steps.py check --jobs 2 && mkdocs build --strict

docs: $(STAMP)
	mkdocs serve

clean:
	rm -rf $(VENV) site site-check

$(STAMP): constraints.txt pyproject.toml
	VENV=$(VENV) bash tools/install.sh
	rm -f $(VENV)/.installed-* && touch $@
