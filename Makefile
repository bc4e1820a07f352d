# Two entry points (see README.md): `make run` starts chronomq with embedded defaults,
# `make test` installs everything into .venv and runs the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test lint venv clean

$(STAMP): pyproject.toml setup.py src/chronomq/store/_speedups.pyx src/chronomq/remoting/_decode.pyx
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,fast,spark,bench,web,grpc]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/chronomq start

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/mypy

# The unit tests run once more on the pure-Python kernels (chronomq/store/speedups.py), then the whole suite
# on the compiled ones. Both on four pytest-xdist workers on this 2-core machine: much of the suite waits
# (JVM starts, delays, clients' intervals), and the third and fourth workers fill those waits (suite on a
# fresh clone, idle: two workers 11 min 53 s, three 8 min 8 s - 9 min 16 s, four 7 min 12 s;
# docs/testing.md). Tests sharing a module or wider fixture stay on one worker (tests/conftest.py).
# `make test PYTEST_XDIST=` runs them in one process.
PYTEST_XDIST ?= -n 4 --dist loadscope --no-loadscope-reorder
# Every test's time and outcome also go to test-artifacts/suite.xml (JUnit XML), for a look at where a
# run's time went beyond the ten slowest.
# The tests write Python's bytecode caches (__pycache__, ignored by git) even where the environment says
# PYTHONDONTWRITEBYTECODE=1: otherwise every pytest worker rewrites every test module's asserts again
# (6.4 -> 2.3 CPU-s to collect tests/unit) and every Python process a test starts (brokers, Spark's Python
# workers, client scripts) compiles chronomq anew (about 0.6 CPU-s each; docs/testing.md).
WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=
test: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/mypy
	$(WRITE_BYTECODE) CHRONOMQ_PURE_PYTHON=1 $(BIN)/python -m pytest -q $(PYTEST_XDIST) tests/unit
	$(WRITE_BYTECODE) $(BIN)/python -m pytest $(PYTEST_XDIST) --durations=10 --junitxml=test-artifacts/suite.xml

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
