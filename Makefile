# Every target sets up what it needs on a fresh machine; running one twice does no harm.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 lies on disk here; override for another build, e.g.
#   make venv TORCH_SPEC='torch==2.13.0+cu126'
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv venv-compat test test-fast test-compat test-restarts study lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so resolving the project's range never pulls another multi-GB build
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[lab,dev,integrations]"
	touch $(STAMP)

# The compat tier (tests marked `compat`) on a second torch release in its own venv: the CUDA build
# of 2.14.1 (it runs on CPU) and torchvision, both on this machine's disk. dpscale goes in after
# them, and the install fails if it brought or changed anything of torch's family (docs/torch-versions.md).
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
COMPAT_STAMP := $(COMPAT_VENV)/.installed
TORCH_FAMILY := '^((torch|torchvision|torchaudio|triton)(==| @)|nvidia-|cuda-)'

venv-compat: $(COMPAT_STAMP)

$(COMPAT_STAMP): pyproject.toml Makefile
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q $(COMPAT_TORCH_SPEC)
	$(COMPAT_PY) -m pip freeze | grep -iE $(TORCH_FAMILY) > $(COMPAT_VENV)/torch-family.before
	$(COMPAT_PY) -m pip install -e ".[lab,dev,integrations]"
	$(COMPAT_PY) -m pip freeze | grep -iE $(TORCH_FAMILY) | diff $(COMPAT_VENV)/torch-family.before -
	touch $(COMPAT_STAMP)

# The tests that start no process run in PYTEST_WORKERS pytest-xdist workers (0: one process):
# alone they keep one core busy, two workers use both of a 2-core host. The slow tests run in two
# lanes side by side. Those marked `waits` spend most of their time waiting (on their own timeouts,
# a cut link, a stopped worker: their CPU seconds a small part of their wall seconds, measured with
# `pytest --cpu-times FILE`) and run in the background, one at a time; the others run one at a time
# in the foreground: each keeps both cores busy with its ranks already, and two of those side by
# side ran slower here (18 process-heavy tests: 172 s with two workers, 123 s one at a time). The
# waiting lane's output follows the other's; a failure in either fails the target. A background
# command ignores SIGINT (no job control): an interrupt ends the waiting lane through the trap.
# Exit status 5 is pytest's "no test selected": fine for a lane when PYTEST_ARGS names tests of
# other lanes only.
# PYTHONDONTWRITEBYTECODE is cleared for the tests: with it set, pytest rewrites the asserts of every
# test module again in each pytest process (a few CPU seconds each) instead of reading __pycache__.
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) --dist loadgroup
PYTEST = PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

test: venv
	$(PYTEST) -q $(XDIST) -m "not slow" $(PYTEST_ARGS); fast=$$?; \
	lane=$$(mktemp); \
	$(PYTEST) -q -p no:cacheprovider -m "slow and waits" $(PYTEST_ARGS) > $$lane 2>&1 & waiting=$$!; \
	trap 'kill $$waiting 2>/dev/null; rm -f $$lane; exit 130' INT TERM; \
	$(PYTEST) -q -m "slow and not waits" $(PYTEST_ARGS); slow=$$?; \
	wait $$waiting; waits=$$?; \
	echo "---- the slow tests that mostly wait (marked waits), run beside the others:"; \
	cat $$lane; rm -f $$lane; \
	for rc in $$fast $$slow $$waits; do { [ $$rc = 0 ] || [ $$rc = 5 ]; } || exit 1; done; \
	[ $$fast$$slow$$waits != 555 ]

# the edit loop: every test that starts no process (starting one fails the test), under 60 s
test-fast: venv
	DPSCALE_TEST_NO_SPAWN=1 $(PYTEST) -q $(XDIST) -m "not slow" -p no:cacheprovider $(PYTEST_ARGS)

# the two-host kill-and-recover scenario N times under a load of one busy process per core (needs
# root: network namespaces); prints "k/N recovered" and keeps both hosts' logs of each failed try
RESTART_TRIES ?= 20
test-restarts: venv
	LOAD=$$(nproc) PYTHON=$(PY) scripts/multihost_restarts.sh $(RESTART_TRIES)

test-compat: venv-compat
	PYTHONDONTWRITEBYTECODE= $(COMPAT_PY) -m pytest -q -m compat -p no:cacheprovider $(PYTEST_ARGS)

study: venv
	$(VENV)/bin/dpscale study $(STUDY_ARGS)

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples scripts
	$(VENV)/bin/mypy

bench: venv
	$(PY) benchmarks/engine.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build src/*.egg-info .pytest_cache
