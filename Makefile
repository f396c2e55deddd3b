# lmcli developer commands. `make install` then `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13 is on this machine's disk; installing it first keeps the
# resolver from fetching a multi-GB CUDA build. Elsewhere pip picks any torch in range.
TORCH_PIN ?= torch==2.13.0

.PHONY: install test lint bench clean

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN) || $(BIN)/pip install -q "torch>=2.4,<3"
	$(BIN)/pip install -q -e ".[dev]"
	@echo "installed: activate with 'source $(VENV)/bin/activate', then run 'lmcli --help'"

test:
	$(BIN)/python -m pytest tests

lint:
	$(BIN)/ruff check lmcli tests bench
	$(BIN)/ruff format --check lmcli tests bench

bench:
	$(BIN)/python -m bench.run

clean:
	rm -rf .pytest_cache build *.egg-info
