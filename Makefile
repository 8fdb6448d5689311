# Two entry points: `make serve` and `make test`. Both build .venv from nothing on first use,
# installing the CPU build of torch 2.13.0 first and pinning it for every later install.
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup serve test

$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	@command -v $${CXX:-g++} >/dev/null || echo "make: no C++ compiler ($${CXX:-g++}): nanoserve's CPU kernels will not be built (torch computes instead); install g++ first for them"
	@echo "make: installing nanoserve; its build compiles the CPU kernels (a few minutes on 2 cores)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/nanoserve serve $(ARGS)

test: setup
	$(BIN)/ruff check nanoserve tests scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest
