# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned here, not in pyproject: 2.13.0 is the CPU wheel on this machine's disk, while a loose
# range would pull a CUDA build of several GB. The package itself keeps torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup dev demo test bench lint docs clean chromium slurm

$(VENV)/.setup: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.setup
	$(PIP) install -q -e ".[dev]"
	$(MAKE) --no-print-directory chromium
	$(MAKE) --no-print-directory slurm
	touch $@

# Headless Chromium for the Training-page tests (tests/monitor): Debian's package, installed with apt
# when it is missing. Without apt (or rights to use it) this says so and goes on; those tests then
# fail and name the fix.
APT := $(shell command -v apt-get 2>/dev/null)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
	  || { [ -n "$(APT)" ] && { $(SUDO) apt-get install -y -q chromium \
	       || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }; }; } \
	  || echo "chromium is not installed and apt-get could not install it: the tests in tests/monitor need it"

# Slurm and munge for tests/deploy/test_slurm.py, which starts a one-node Slurm of its own (Debian's
# daemons, its configuration in a temporary directory): installed with apt when missing, without the
# recommended plugins (the basic ones hold all the test uses). Without apt (or rights to use it)
# this says so and goes on; that test then skips, naming the fix.
slurm:
	@command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] \
	  || { [ -n "$(APT)" ] && { $(SUDO) apt-get install -y -q --no-install-recommends $(SLURM_DEBS) \
	       || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q --no-install-recommends $(SLURM_DEBS); }; }; } \
	  || echo "Slurm is not installed and apt-get could not install it: tests/deploy/test_slurm.py skips"
SLURM_DEBS := slurmctld slurmd slurm-client munge

setup: $(VENV)/.setup

dev: $(VENV)/.dev

demo: $(VENV)/.setup
	$(VENV)/bin/dask-train demo

# Two test processes (pytest-xdist): one at a time leaves this 2-core machine about half idle
# (tests wait on worker processes starting, on kills and hold bounds); two at a time ran the
# suite in 604 s against 790 s. Two still leave a fifth of it idle, but three were no faster
# (fresh clones: 701 s with three, 706 s with two; each test slower under the load) and load
# the timing of the kill and departure tests more. PYTEST_WORKERS=1 runs them one at a time.
PYTEST_WORKERS ?= 2
test: $(VENV)/.dev
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15

bench: $(VENV)/.setup
	$(PY) benchmarks/throughput.py

lint: $(VENV)/.dev
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m mypy

# The documentation site, warnings as errors (tests/test_docs.py builds it as well, so CI catches a
# broken docstring). -E: a fresh environment each time, so warnings from pages left unchanged since the
# last build are reported again rather than hidden by the cache (a build takes seconds). Open
# docs/_build/html/index.html.
docs: $(VENV)/.setup
	$(PY) -c "import sphinx, numpydoc, pydata_sphinx_theme, myst_parser" 2>/dev/null || $(PIP) install -q -e ".[docs]"
	$(PY) -m sphinx -E -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) demo-output build *.egg-info src/*.egg-info docs/_build docs/generated
