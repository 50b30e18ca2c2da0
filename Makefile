# Two entry points (see README): `make run` and `make test`. Each sets up what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test lint slow validate

$(VENV)/bin/python:
	python3 -m venv $(VENV)

# the simulator core: no torch
$(VENV)/.core: pyproject.toml | $(VENV)/bin/python
	$(PIP) -e .
	touch $@

# calibration/validation and the dev tools: torch 2.13.0 (CPU wheel) first, then deepspeed
$(VENV)/.full: pyproject.toml | $(VENV)/bin/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[calibrate,dev]"
	touch $@ $(VENV)/.core

run: $(VENV)/.core
	$(VENV)/bin/zsim run

lint: $(VENV)/.full
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -n 2

slow: $(VENV)/.full
	$(PY) -m pytest -m slow

# the whole local loop (root, about an hour on this 2-core VM): calibrate each layout, validate
# ZeRO stages 0-3 against real DeepSpeed runs, write benchmarks/validation/; fails past 10 % MAPE
validate: $(VENV)/.full
	$(PY) benchmarks/validation/loop.py
