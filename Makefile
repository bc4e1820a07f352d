# Two entry points (see README.md): `make run` starts chronomq with embedded defaults,
# `make test` installs everything into .venv and runs the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test lint venv clean

$(STAMP): pyproject.toml setup.py src/chronomq/store/_speedups.pyx
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

# The unit tests run once more on the pure-Python kernels (chronomq/store/speedups.py), in one process beside
# the whole suite on the compiled ones: the suite's first half waits on JVM starts and delays with the cores
# a third idle (docs/testing.md), which the pure pass fills. Its log is .pure-unit.log, shown whole when it
# fails. The suite runs on two pytest-xdist workers (more gain little: it is CPU bound); tests sharing a
# module or wider fixture stay on one worker (tests/conftest.py). `make test PYTEST_XDIST=` runs the suite
# in one process.
PYTEST_XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder
PURE_LOG := .pure-unit.log
test: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	@echo "the unit tests on the pure-Python kernels run beside the suite (log: $(PURE_LOG))"
	@CHRONOMQ_PURE_PYTHON=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/unit >$(PURE_LOG) 2>&1 & \
	pure=$$!; \
	$(BIN)/python -m pytest $(PYTEST_XDIST) --durations=10; suite=$$?; \
	wait $$pure; unit=$$?; \
	echo "== the unit tests on the pure-Python kernels (CHRONOMQ_PURE_PYTHON=1):"; \
	if [ $$unit = 0 ]; then tail -n 1 $(PURE_LOG); else cat $(PURE_LOG); fi; \
	[ $$suite = 0 ] && [ $$unit = 0 ]

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
