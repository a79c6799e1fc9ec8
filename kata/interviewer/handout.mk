# Attention-wrapper kata. `make` alone lists the targets.
PYTHON ?= python3
KATA := $(PYTHON) -m kata

.DEFAULT_GOAL := help
.PHONY: help deps build kata watch reset

help: ## list the targets
	@echo "Attention-wrapper kata"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 22

deps: ## install the missing dependencies (never replaces an installed torch)
	@$(PYTHON) -m kata.toolchain.deps

build: deps ## build flawed/custom_attention.so for this machine
	@$(KATA) build

kata: deps ## run the checks: one line per flaw, red until every flaw is fixed
	@$(KATA) check

watch: deps ## re-run the checks whenever a file under flawed/ is saved
	@$(KATA) watch

reset: ## restore the shipped flawed/ (asks first; keeps a backup of your copy)
	@$(PYTHON) -m kata reset
