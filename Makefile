# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of this version lies on the development machines' disk; an open
# range would pull a multi-GB CUDA build. Only installed when no torch exists.
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: install install-test prometheus demo test lint bench monitor clean

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

# Prometheus and promtool (Debian package `prometheus`) for the monitoring tests and `make monitor`:
# apt-get as root (CI), through sudo otherwise; the package's service is not needed (tests start their own).
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  if [ -n "$$SUDO" ] && ! command -v sudo >/dev/null; then \
	    echo "make: not root and no sudo: install the Debian package prometheus by hand (its tests skip until then)" >&2; \
	  else \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  fi; }

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test prometheus

## demo: a 2-process CPU job of shapes-segmentation on the embedded defaults, from step 0 each time
## (the same torchrun command run again would resume, and find the demo already finished).
demo: install
	rm -rf runs/demo
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m service train --set run_dir=runs/demo
	@echo "--- runs/demo/summary.json"
	@cat runs/demo/summary.json

## monitor: a real Prometheus (with monitoring/rules.yml) scraping a local 2-process job; prints the URL and
## example queries, and stops both when the job ends. MONITOR_ARGS go to launch/monitor.sh.
MONITOR_ARGS ?=
monitor: install prometheus
	PYTHON=$(PY) launch/monitor.sh $(MONITOR_ARGS)

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
