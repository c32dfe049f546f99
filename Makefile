# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of this version lies on the development machines' disk; an open
# range would pull a multi-GB CUDA build. Only installed when no torch exists.
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
PYTEST_ARGS ?= --durations=60

.PHONY: help install install-test prometheus slurm demo test test-quick lint bench gpu-check monitor clean
.DEFAULT_GOAL := help

## help: this list: each target and its `##` lines (a bare `make` prints it too).
help:
	@awk '/^## [a-z-]+:/ { sub(/^## /, ""); name = substr($$0, 1, index($$0, ":") - 1); \
	        printf "  %-13s%s\n", name, substr($$0, length(name) + 3); more = 1; next } \
	      /^## / && more { printf "  %-13s%s\n", "", substr($$0, 4); next } { more = 0 }' $(firstword $(MAKEFILE_LIST))

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

# apt_install(commands, packages, why): install Debian packages when one of the commands is missing:
# apt-get as root (CI), through sudo otherwise; their services are not needed (the tests start their own).
define apt_install
	@missing=; for c in $(1); do command -v $$c >/dev/null || missing=1; done; [ -z "$$missing" ] || { \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  if [ -n "$$SUDO" ] && ! command -v sudo >/dev/null; then \
	    echo "make: not root and no sudo: install the Debian packages $(2) by hand ($(3) skip until then)" >&2; \
	  else \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $(2) >/dev/null; \
	  fi; }
endef

## prometheus: Prometheus and promtool (Debian packages) for the monitoring tests and `make monitor`.
prometheus:
	$(call apt_install,promtool prometheus,prometheus,the monitoring tests)

## slurm: Slurm and munge (Debian packages) for tests/test_slurm.py, which starts its own two-node cluster
## on this machine.
slurm:
	$(call apt_install,slurmctld slurmd munged,slurm-wlm munge,the Slurm tests)

## install: the venv (.venv) with torch (TORCH_VERSION, a CPU build, when the venv has none) and this package.
install: $(VENV)/.installed
## install-test: install, the test dependencies, Prometheus and Slurm.
install-test: $(VENV)/.installed-test prometheus slurm

## demo: a 2-process CPU job of shapes-segmentation on the embedded defaults, through `ddp-service launch`
## (torchrun's agent, standalone), from step 0 each time (the same command run again would resume, and find
## the demo already finished).
demo: install
	rm -rf runs/demo
	$(VENV)/bin/ddp-service launch --nproc-per-node=$(NPROC) --set run_dir=runs/demo
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

## test: the whole suite, real processes included. Most e2e tests wait (on rendezvous rounds, signals,
## sleeps in their tasks) more than they compute, so two pytest workers halve the wall time on 2 cores;
## each takes whole files (--dist loadfile), so a module's cluster or Prometheus fixture starts once, in the
## order tests/conftest.py gives (heaviest first; xdist would otherwise re-sort files by their number of tests).
## TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install-test
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

## test-quick: the unit and property tests alone (-m "not e2e"): no test starts a process (tests/conftest.py
## fails one that does without the e2e marker), so no torchrun, etcd, Slurm, Prometheus or tools; about a
## minute on 2 cores (docs/development.md). Needs only the Python test dependencies.
test-quick: $(VENV)/.installed-test
	$(PY) -m pytest -m "not e2e" $(XDIST) $(PYTEST_ARGS)

## bench: the loop-overhead, step-boundary CPU, metrics-overhead, snapshot-overhead, rendezvous (and its etcd-side replay), lease keep-alive and checkpoint
## benchmarks (not tests; they print ratios).
bench: install-test
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) bench/overhead.py
	$(PY) bench/boundary.py
	$(PY) bench/metrics_overhead.py
	$(PY) bench/snapshot_overhead.py
	$(PY) bench/rendezvous.py
	$(PY) bench/rendezvous_replay.py
	$(PY) bench/keepalive.py
	$(PY) bench/checkpoint.py

## gpu-check: one table (check, result, figure, seconds) of what one CUDA device says about this tree, in under
## 5 minutes: the CUDA tests, each AMP mode, the examples, pinned async checkpoints, NCCL at 1 and 2 ranks, the
## benches. Without CUDA every row skips at once. GPU_CHECK_ARGS go to bench/gpu_check.py (--budget, --only).
GPU_CHECK_ARGS ?=
gpu-check: install-test
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

## clean: remove the venv, runs/ and the build leftovers.
clean:
	rm -rf $(VENV) runs build *.egg-info
