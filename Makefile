# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of this version lies on the development machines' disk; an open
# range would pull a multi-GB CUDA build. Only installed when no torch exists.
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: install install-test demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

## demo: a 2-process CPU job of shapes-segmentation on the embedded defaults, from step 0 each time
## (the same torchrun command run again would resume, and find the demo already finished).
demo: install
	rm -rf runs/demo
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m service train --set run_dir=runs/demo
	@echo "--- runs/demo/summary.json"
	@cat runs/demo/summary.json

## lint: ruff (lint and format check) over the tree, mypy over service/ (settings in pyproject.toml).
lint: install-test
	$(PY) -m ruff check service tests bench examples
	$(PY) -m ruff format --check service tests bench examples
	$(PY) -m mypy

## test: the whole suite, real processes included.
test: install-test
	$(PY) -m pytest $(PYTEST_ARGS)

## bench: the loop-overhead and rendezvous benchmarks (not tests; they print ratios).
bench: install-test
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/overhead.py
	$(PY) bench/rendezvous.py
	$(PY) bench/checkpoint.py

clean:
	rm -rf $(VENV) runs build *.egg-info
