# Two entry points, each doing all of its own set-up from a fresh clone:
#   make report   the main job (on the CPU when there is no GPU)
#   make test     the whole test suite (what CI runs)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup report test
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

# Two pytest-xdist workers, a test file each at a time (CI's machine has two cores).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile
