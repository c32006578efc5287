# Every target sets up what it needs on a fresh machine; running one twice does no harm.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 lies on disk here; override for another build, e.g.
#   make venv TORCH_SPEC='torch==2.13.0+cu126'
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast study lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so resolving the project's range never pulls another multi-GB build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[lab,dev,integrations]"
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the edit loop: every test that starts no process (starting one fails the test), under 90 s
test-fast: venv
	DPSCALE_TEST_NO_SPAWN=1 $(PY) -m pytest -q -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

study: venv
	$(VENV)/bin/dpscale study $(STUDY_ARGS)

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples scripts
	$(VENV)/bin/mypy

bench: venv
	$(PY) benchmarks/engine.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
