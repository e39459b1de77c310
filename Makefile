# Two entry points for a fresh machine: `make demo` (generate an image) and `make test` (the suite).
# Each creates .venv itself. torch is a test-only reference; its CPU wheel is installed first so that
# nothing pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= default
# eight prompts of the shapes world the default model was trained on (train/shapes.py)
DEMO_PROMPTS := "a red circle on a blue background" "a yellow triangle on a purple background" \
	"a white square on a black background" "a green circle on an orange background" \
	"a blue square on a yellow background" "an orange triangle on a green background" \
	"a purple circle on a white background" "a black triangle on a red background"
PROMPT ?=

.PHONY: demo serve test docs venv venv-train venv-test venv-serve venv-docs default-models clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.train: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[train]'
	touch $(VENV)/.runtime $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'  # the suite builds the documentation site too (tests/test_docs.py)
	# only for its packaged CLIP BPE vocabulary (its own dependencies would pull torchvision)
	$(BIN)/pip install -q --no-deps open_clip_torch
	# the second scheduler reference, for its sampling.py alone (tests/test_schedulers_kdiffusion.py); its
	# dependencies would pull torchvision too
	$(BIN)/pip install -q --no-deps k-diffusion==0.1.1.post1
	# the server's page is tested in Debian's Chromium (tests/test_serve_page.py), driven by Playwright's package
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	touch $(VENV)/.runtime $(VENV)/.train $(VENV)/.docs $(VENV)/.serve $@

$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[serve]'
	touch $(VENV)/.runtime $@

$(VENV)/.docs: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[docs]'
	touch $(VENV)/.runtime $(VENV)/.train $@

venv: $(VENV)/.runtime
venv-train: $(VENV)/.train
venv-test: $(VENV)/.test
venv-serve: $(VENV)/.serve
venv-docs: $(VENV)/.docs

# A grid of eight prompts from the default model (outputs/demo-grid.png; the single images in outputs/demo/).
# Another model and prompt: make demo MODEL=stabilityai/stable-diffusion-xl-base-1.0 PROMPT="a lighthouse"
demo: venv
	$(BIN)/python -m sdx.sample --model $(MODEL) --prompt $(if $(PROMPT),"$(PROMPT)",$(DEMO_PROMPTS)) \
		--output outputs/demo --grid outputs/demo-grid.png --overwrite

# The API and page of python -m sdx.serve on http://127.0.0.1:7860 (this machine only), until Ctrl-C.
serve: venv-serve
	$(BIN)/python -m sdx.serve --model $(MODEL)

# The default models from scratch (train/recipe.sh): datasets, VAE, text-to-image, InstructPix2Pix, pack, evaluation.
default-models: venv-train
	PYTHON=$(BIN)/python bash train/recipe.sh

test: venv-test
	$(BIN)/python -m pytest -n 2 --dist loadfile -q tests

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or an orphan page is an error.
docs: venv-docs
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) outputs .pytest_cache site
