# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The oldest tensordict we support (verl pins >=0.8): the assembly tests run against it too.
TD_OLDEST_VERSION := 0.8.3
TD_OLDEST := $(VENV)/compat/tensordict-$(TD_OLDEST_VERSION)

.PHONY: setup demo test lint typecheck unit bench soak clean

setup: $(STAMP)

# Idempotent: creates the venv if it is missing, reinstalls when the dependencies change.
$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(TD_OLDEST) 'tensordict==$(TD_OLDEST_VERSION)'
	@touch $(STAMP)

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/turnstream demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

test: lint typecheck
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

unit: setup
	$(BIN)/python -m pytest -q tests/unit

bench: setup
	@set -e; for b in $$(ls benchmarks/*.py | grep -v '/_'); do \
		echo "== $$b"; PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python $$b $(BENCH_ARGS); \
	done

# The full chaos soak (docs/RELIABILITY.md): 10 minutes of SIGKILLs, >= 100 faults, then an audit.
# `make soak SOAK_ARGS="--seed 7 --data-dir /tmp/soak"` reproduces a run.
soak: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m tests.chaos.soak --duration-s 600 $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
