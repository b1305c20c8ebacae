# `make demo` and `make test` work on a fresh machine: both set up .venv first when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvrig-setup-5
# pytest workers (pytest-xdist): tests spend much of their time waiting on subprocesses, virtual phones and their
# deadlines, so a third worker fills the cores while two wait, even on two cores. Each test file stays on one
# worker, so module fixtures are built once; files go out in collection order (tests/conftest.py puts the longest
# first), not xdist's most-tests-first.
PYTEST_WORKERS ?= 3
# libopenblas0-pthread: MLX CPU matmul; libimobiledevice: the device tools; fortunes, libc6-dev,
# libpython3-stdlib, python3-doc, debian-reference-en: the kinds of text quality is calibrated and measured on (kvrig/texts.py);
# the rest: the Linux build of the Swift engine where MLX Swift resolves (BLAS/LAPACK; g++ for MLX's compile JIT).
DEBIAN_PACKAGES := libopenblas0-pthread libimobiledevice-utils ideviceinstaller \
	fortunes libc6-dev libpython3-stdlib python3-doc debian-reference-en \
	libblas-dev liblapacke-dev libopenblas-dev liblapack-dev gfortran g++

.PHONY: setup test demo docs docs-measure lint typecheck clean

setup: $(STAMP)

# kvrig needs Python 3.11+; a Mac's /usr/bin/python3 is 3.9: refuse it by name, and never keep a venv made from it.
PY_OK := import sys; sys.exit(sys.version_info < (3, 11))

$(STAMP): pyproject.toml Makefile scripts/install-python-packages.sh
	@$(PY) -c '$(PY_OK)' || { echo "kvrig needs Python 3.11 or later; $(PY) is $$($(PY) -V 2>&1): make PY=python3.11 (or newer)" >&2; exit 1; }
	bash scripts/install-debian-packages.sh $(DEBIAN_PACKAGES)
	{ test -x $(BIN)/python && $(BIN)/python -c '$(PY_OK)'; } || { rm -rf $(VENV) && $(PY) -m venv $(VENV); }
	bash scripts/install-python-packages.sh $(VENV) mlx,device,dev,coreml
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check kvrig tests
	$(BIN)/ruff format --check kvrig tests
	$(BIN)/mypy
	# The layers in pyproject.toml ([tool.importlinter]): imports run one way, no cycles, no MLX where none belongs.
	$(BIN)/lint-imports
	# The app's engine for this host against the pinned MLX Swift (debug; incremental in .build/swift-engine).
	# Where MLX Swift cannot be resolved (no network, no KVRIG_SWIFT_DEPS, no mirror: docs/engine-linux.md) this
	# records why and the engine tests skip with that reason; a build that resolved and failed stops here.
	$(BIN)/kvrig engine --skip-unresolvable
	# --durations: the slowest tests in every log, so where the time goes is never a guess (pyproject's -ra lists
	# every skip with its reason).
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

demo: $(STAMP)
	$(BIN)/kvrig demo -o build/demo

# The docs' measured figures: docs-measure reruns every benchmark docs/benchmarks.yaml names (tens of minutes on
# 2 cores) into docs/data; docs renders the pages' generated sections from that JSON (seconds).
docs-measure: $(STAMP)
	$(BIN)/kvrig docs measure --all

docs: $(STAMP)
	$(BIN)/kvrig docs render

lint: $(STAMP)
	$(BIN)/ruff check kvrig tests
	$(BIN)/ruff format --check kvrig tests
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info
