# Two entry points for a fresh machine: `make demo` (generate an image) and `make test` (the suite).
# Each creates .venv itself. torch is a test-only reference; its CPU wheel is installed first so that
# nothing pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= a watercolor lighthouse at dawn
MODEL ?= tiny

.PHONY: demo test venv venv-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# only for its packaged CLIP BPE vocabulary (its own dependencies would pull torchvision)
	$(BIN)/pip install -q --no-deps open_clip_torch
	touch $(VENV)/.runtime $@

venv: $(VENV)/.runtime
venv-test: $(VENV)/.test

demo: venv
	$(BIN)/python -m sdx.sample --model $(MODEL) --prompt "$(PROMPT)" --output outputs/demo.png --overwrite

test: venv-test
	$(BIN)/python -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) outputs .pytest_cache
