# Two entry points: `make serve` and `make test`. Both build .venv from nothing on first use,
# installing the CPU build of torch 2.13.0 first and pinning it for every later install.
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup serve test

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/nanoserve serve $(ARGS)

test: setup
	$(BIN)/ruff check nanoserve tests scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest
