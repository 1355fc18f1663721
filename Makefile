# kbd — two commands for a newcomer: `make demo` and `make test`.
# The system Python 3.11 (Debian 12's /usr/bin/python3); a pyenv shim on PATH may be another build.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3.11 /usr/bin/python3) $(shell command -v python3.11 python3))
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO_ROOT ?= .demo

.PHONY: venv demo mcp-example check test lint typecheck unit security bench nightly screenshots clean man

# An editable install in setuptools' `compat` mode: one static .pth line (this
# folder) instead of the import-hook finder of the default mode, whose imports
# (pathlib, re, importlib.util) cost every Python start in the venv about 8 ms;
# a brokered `kbd exec` is a Python start. It also puts tests/ and bench/ on the
# venv's path, which is harmless in a development venv (pytest adds this folder
# anyway). setuptools calls compat transitional: if a release drops it, the
# second line installs in the default mode (slower starts, same behaviour).
# Hosts install kbd without -e (`pip install .`): no finder, no .pth.
$(BIN)/kbd: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS='ignore:Compat editable installs' \
	  $(BIN)/pip install --quiet -e '.[dev]' --config-settings editable_mode=compat \
	  || $(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

venv: $(BIN)/kbd

# Build a fresh demo root and show what kbd resolves for the demo consumer.
demo: venv
	@bash scripts/demo.sh $(BIN)/kbd $(DEMO_ROOT)

# An agent's side of `kbd mcp`: the registration in docs/mcp.md, every tool called once.
mcp-example: venv
	$(BIN)/python scripts/mcp-example.py

lint: venv
	$(BIN)/ruff check kbd tests bench
	$(BIN)/ruff format --check kbd tests bench
	$(BIN)/vulture

typecheck: venv
	$(BIN)/mypy

# The fast loop (README "Development"): lint, strict types and the unit tests on
# the quick hypothesis profile, two workers; under a minute on a 2-core machine.
check: lint typecheck
	HYPOTHESIS_PROFILE=quick $(BIN)/pytest -q -n 2 tests/unit

# The whole suite: lint, strict types, every test (security suite on the CI
# hypothesis profile), in parallel, with a coverage report of the test processes.
# Most tests wait on subprocesses, sandboxes and sockets, so more workers than
# cores pays (README "Development"); each test module stays on one worker
# (loadfile), so its module-scoped daemons and worlds are built once.
# COVERAGE= turns the report off.
TEST_WORKERS ?= 4
COVERAGE ?= --cov --cov-report=term
test: lint typecheck
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(COVERAGE)

security: venv
	$(BIN)/pytest -q tests/security

# The Knowledge page's screenshots (each panel at 1280x800, and a 400 px wide
# window), taken by the browser tests in Debian's Chromium (apt-get install
# chromium), into docs/screenshots/. Only the README's pictures are committed (.gitignore).
screenshots: venv
	KBD_SCREENSHOTS=$(CURDIR)/docs/screenshots $(BIN)/pytest -q tests/browser/test_browse.py -k screenshots

# Longer hypothesis runs for a nightly job (5,000 examples a property: far beyond
# the 120 s per-test timeout that guards `make test`).
nightly: venv
	HYPOTHESIS_PROFILE=nightly $(BIN)/pytest -q --timeout=3600 tests/security tests/unit

# docs/performance.md figures. Bytecode is compiled first, as an installed package has it.
bench: venv
	$(BIN)/python -m compileall -q kbd >/dev/null
	for b in paths registry sessions api api_load event_flood access_log exec cli notes gate live import search mcp_read why refusals; do echo; $(BIN)/python bench/$$b.py || exit 1; done

# Man pages from the CLI's own definitions (kbd/cli/manpages.py), into build/man/ (never committed).
man: venv
	$(BIN)/python scripts/man.py build/man

clean:
	rm -rf $(VENV) $(DEMO_ROOT) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info .coverage .coverage.*
