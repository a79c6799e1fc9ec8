# Attention-wrapper kata. `make` alone lists the targets.
PYTHON ?= python3
CANDIDATE ?=
KATA := $(PYTHON) -m kata

.DEFAULT_GOAL := help
.PHONY: help deps build review kata test lint reset bench clean

help: ## list the targets
	@echo "Attention-wrapper kata"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 22

deps: ## install the missing dependencies (never replaces an installed torch)
	@$(PYTHON) -m kata.deps

build: deps ## build flawed/custom_attention.so for this machine and the fixed/ extension
	@$(KATA) build
	@$(KATA) build --impl fixed

review: deps ## scorecard of flawed/ (or CANDIDATE=path/to/copy)
	@$(KATA) review --impl $(or $(CANDIDATE),flawed)

kata: deps ## the candidate's checks: red until every flaw in flawed/ is fixed
	@$(PYTHON) -m pytest -q --no-header -p no:cacheprovider kata/kata_checks.py

test: deps lint ## fixed/ passes, shipped flawed/ fails, harness and rubric agree
	@$(PYTHON) -m pytest

lint: deps ## ruff check and ruff format --check
	@ruff check .
	@ruff format --check .

reset: ## restore the shipped flawed/ (asks first; keeps a backup of your copy)
	@$(PYTHON) -m kata reset

bench: deps ## benchmarks (not yet)
	@$(KATA) bench

clean: ## remove build outputs and caches
	rm -rf build fixed/_build flawed/custom_attention.so flawed/.custom_attention.build
	rm -rf .pytest_cache .ruff_cache .kata-hints.json
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
