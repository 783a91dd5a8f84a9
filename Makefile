# Two entry points, each doing all of its own set-up from a fresh clone:
#   make report   the main job (on the CPU when there is no GPU)
#   make test     the test suite less its slow tier (what CI runs)
#   make test-all the whole test suite, slow tier included
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup report test test-all
setup: $(STAMP)

# torch==2.13.0 first: on these machines pip takes the local CPU wheel, where a
# plain "torch" would pull the newest CUDA build (gigabytes). triton 3.6 is the
# GPU machine's version; its CPU interpreter needs numpy < 2.4.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check "triton==3.6.0" "numpy<2.4"
	$(BIN)/pip install -q --disable-pip-version-check -e .
	touch $(STAMP)

report: $(STAMP)
	$(BIN)/attnlab report --out reports/cpu

# Two pytest-xdist workers (CI's machine has two cores), tests dealt out one at a time except the groups that share
# a cache (a backward check's gradients: properties/conftest.py); hypothesis derandomized (the same cases, the same
# time, every run). CI keeps to 15 minutes without the slow tier (pytest's "slow" marker).
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadgroup --attnlab-profile ci
test: $(STAMP)
	$(PYTEST) -m "not slow"

test-all: $(STAMP)
	$(PYTEST)
