# The two commands of README.md: `make up` runs the local stack, `make test` runs the tests.
# Each creates .venv when missing and installs the project into it first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: up test lint typecheck clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/inferlb up $(CONFIG)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
