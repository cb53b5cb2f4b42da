# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The oldest tensordict we support (verl pins >=0.8): the assembly tests run against it too.
TD_OLDEST_VERSION := 0.8.3
TD_OLDEST := $(VENV)/compat/tensordict-$(TD_OLDEST_VERSION)
# verl for the integration tests (tests/verl, run in a subprocess with this first on the path),
# installed without dependencies so that it never touches the venv's torch: verl, the newest
# tensordict it allows, and the pure-Python packages its trainer and agent-loop modules import.
VERL_VERSION := 0.9.1
VERL := $(VENV)/compat/verl-$(VERL_VERSION)
VERL_PACKAGES := verl==$(VERL_VERSION) tensordict==0.10.0 omegaconf==2.4.0 hydra-core==1.3.8 \
	antlr4-python3-runtime==4.9.3 codetiming==1.4.0 orjson==3.13.0 torchdata==0.11.0 \
	peft==0.21.2 cachetools==8.0.2
# Harbor's ATIF models, to validate `turnstream export --kind atif` in the tests: Harbor needs
# Python >= 3.12 to install, but its trajectory models are plain pydantic and load on 3.11, so
# its wheel alone is unpacked here (tests/helpers/harbor.py); turnstream never imports it.
HARBOR_VERSION := 0.26.0
HARBOR := $(VENV)/compat/harbor-$(HARBOR_VERSION)

.PHONY: setup demo test test-slow test-deploy test-agents lint typecheck unit bench soak clean

setup: $(STAMP)

# Idempotent: creates the venv if it is missing, reinstalls when the dependencies change.
$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(TD_OLDEST) 'tensordict==$(TD_OLDEST_VERSION)'
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(VERL) $(VERL_PACKAGES)
	$(BIN)/python -m pip install --quiet --no-deps --upgrade --target $(HARBOR) \
		--python-version 3.12 --only-binary=:all: 'harbor==$(HARBOR_VERSION)'
	@touch $(STAMP)

demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/turnstream demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# Test files run on TEST_WORKERS pytest-xdist workers (one file stays on one worker: its module
# fixtures, a nats-server or a gateway, are started once), the longest files first
# (tests/conftest.py, LONGEST_FIRST): 842 s with 2 on the 2-core VM (fresh-clone CI, 2026-11-26;
# 1363 s serial on 2026-11-25); 3 gave 881 s once (a Ray test starved into its timeout) and
# 985 s another time (all passed): no steady gain on 2 cores. mypy run beside the tests instead
# of before them: 930 s for both against 892 + 43 s, no gain measurable on this VM (the suite
# keeps both cores ~80% busy), so it runs first. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# make test runs the suite less the slow tests, make test-slow runs those (CI: both, make test
# first). Slow: tests/conftest.py's SLOW says which and why (>= ~30 s each, their ground also
# covered by faster tests); tests/test_suite_split.py checks that the two selections below are
# together the whole suite, each test in one. make test: 365 s on the quiet 2-core VM (mypy 23,
# pytest 342; 2026-11-29), where the whole suite's pytest took 606-932 s in CI; make test-slow:
# 35 tests, 362 s (docs/PERFORMANCE.md, issue 38).
FAST_TESTS := -m 'not slow'
SLOW_TESTS := -m slow

test: lint typecheck
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q --durations=25 $(PYTEST_XDIST) $(FAST_TESTS)

test-slow: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q --durations=25 $(PYTEST_XDIST) $(SLOW_TESTS)

# The deployment as users run it (docs: README, Deploying): docker compose under a real Docker
# engine (installed and started if none answers), a 3-node NATS cluster, a real vLLM (CPU). What it
# installs and builds is cached in $TURNSTREAM_DEPLOY_CACHE (~/.cache/turnstream/deploy) and reused
# by the next run on this machine. The dockerd it started is stopped when the run ends (idle, it
# takes ~16% of a core); TURNSTREAM_KEEP_DOCKER=1 keeps it for the next run.
test-deploy: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" TURNSTREAM_TEST_DEPLOY=1 $(BIN)/python -m pytest -q --durations=25 tests/deploy

# Claude Code and Codex CLI (npm, pinned, cached in ~/.cache/turnstream/agents) through the gateway.
test-agents: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" TURNSTREAM_TEST_AGENTS=1 $(BIN)/python -m pytest -q --durations=25 tests/agents

unit: setup
	$(BIN)/python -m pytest -q tests/unit

# The benchmarks make bench has always run: the top-level scripts of benchmarks/ (benchmarks/harness/
# is their library), less those reached through a flag of another: the four whose keys
# gateway_overhead.py's default run reports on its last line, its --api-surfaces, --interleaved and
# --fleet modes, storage.py --subagents, and gateway_compare.py (a paired before/after check of a change).
BENCH_SKIP := per_token|agent_shape|scaleout|litellm_compare|api_surfaces|interleaved|fleet_one_gateway|subagents|gateway_compare
bench: setup
	@set -e; for b in $$(ls benchmarks/*.py | grep -vE '/($(BENCH_SKIP))\.py$$'); do \
		echo "== $$b"; PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python $$b $(BENCH_ARGS); \
	done

# The full chaos soak (docs/RELIABILITY.md): 10 minutes of SIGKILLs, >= 100 faults, then an audit.
# `make soak SOAK_ARGS="--seed 7 --data-dir /tmp/soak"` reproduces a run.
soak: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m tests.chaos.soak --duration-s 600 $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
