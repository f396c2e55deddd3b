# lmcli developer commands. `make install` then `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13 is on this machine's disk; installing it first keeps the
# resolver from fetching a multi-GB CUDA build. Elsewhere pip picks any torch in range.
TORCH_PIN ?= torch==2.13.0

.PHONY: install browser test lint bench clean

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN) || $(BIN)/pip install -q "torch>=2.4,<3"
	$(BIN)/pip install -q -e ".[dev]"
	@echo "installed: activate with 'source $(VENV)/bin/activate', then run 'lmcli --help'"

# Debian's chromium for the chat page's browser test (tests/serve/test_page.py skips without it)
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
		echo "chromium could not be installed: the browser test will be skipped"

test:
	$(BIN)/python -m pytest tests

lint:
	$(BIN)/ruff check lmcli tests bench
	$(BIN)/ruff format --check lmcli tests bench

bench:
	$(BIN)/python -m bench.run

clean:
	rm -rf .pytest_cache build *.egg-info
