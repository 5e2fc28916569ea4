# The two commands of README.md: `make up` runs the local stack, `make test` runs the tests.
# Each creates .venv when missing and installs into it first: `up` the runtime dependencies only, `test` the
# dev extra as well.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Two stamps: `make up` installs only the runtime dependencies; `make test` (and lint/typecheck) add the
# `dev` extra (pytest, ruff, mypy, the openai SDK, matplotlib...) on top.
STAMP     := $(VENV)/.installed-runtime
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: up test lint typecheck clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e .
	touch $(STAMP)

$(DEV_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(DEV_STAMP)

up: $(STAMP)
	$(VENV)/bin/inferlb up $(CONFIG)

test: $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(PY) -m ruff check .

typecheck: $(DEV_STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
