# Attention-wrapper kata. `make` alone lists the targets.
PYTHON ?= python3
CANDIDATE ?=
ROUND ?= 1
MARKDOWN ?=
DEST ?=
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): on a 2-core machine the suite took 500 s instead of 700, the
# tests waiting on builds, time limits and probes overlapping. More on one GPU make verdicts
# wrong (README, GPU notes). 0: one process.
PYTEST_WORKERS ?= 2
KATA := $(PYTHON) -m kata

.DEFAULT_GOAL := help
.PHONY: help deps build review kata watch test test-quick lint reset handout bench clean

help: ## list the targets
	@echo "Attention-wrapper kata"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 22

deps: ## install the missing dependencies (never replaces an installed torch)
	@$(PYTHON) -m kata.toolchain.deps

build: deps ## build flawed/custom_attention.so for this machine and the fixed/ extension
	@$(KATA) build
	@$(KATA) build --impl fixed

review: deps ## scorecard of flawed/ (CANDIDATE=path/to/copy ROUND=2 MARKDOWN=report.md)
	@$(KATA) review --round $(ROUND) $(if $(CANDIDATE),--impl $(CANDIDATE)) \
		$(if $(MARKDOWN),--markdown $(MARKDOWN))

kata: deps ## the candidate's checks: one line per flaw, red until every flaw is fixed
	@$(KATA) check

watch: deps ## re-run the candidate's checks whenever a file under flawed/ is saved
	@$(KATA) watch

test: deps lint ## fixed/ passes, shipped flawed/ fails, harness and rubric agree (PYTEST_ARGS=..., PYTEST_WORKERS=2)
	@$(PYTHON) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# What differs from one torch to the next: every probe on flawed/ and fixed/, fixed/'s operator,
# its build (.ci/run runs it on the oldest supported torch; make test on the newest).
QUICK_TESTS := tests/test_flaws.py tests/test_fixed.py tests/test_fixed_build.py \
	tests/test_sdpa.py tests/test_sdpa_autograd.py tests/test_sdpa_errors.py tests/test_torch_support.py

test-quick: deps lint ## the suite's torch-facing part: probes, fixed/'s operator and build
	@$(PYTHON) -m pytest -n $(PYTEST_WORKERS) $(QUICK_TESTS) $(PYTEST_ARGS)

lint: deps ## ruff check and ruff format --check
	@ruff check .
	@ruff format --check .

reset: ## restore the shipped flawed/ (asks first; keeps a backup of your copy)
	@$(PYTHON) -m kata reset

handout: deps ## a candidate-ready copy without fixed/ or any answers: make handout DEST=dir
	@$(KATA) handout --round $(ROUND) $(DEST)

bench: deps ## flawed vs fixed vs SDPA: a table and bench.json (python -m kata bench --help)
	@$(KATA) bench

clean: ## remove build outputs and caches
	rm -rf build fixed/_build flawed/custom_attention.so flawed/.custom_attention.build
	rm -rf .pytest_cache .ruff_cache .kata-hints.json
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
