# lmcli developer commands. `make install` then `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13 is on this machine's disk; installing it first keeps the
# resolver from fetching a multi-GB CUDA build. Elsewhere pip picks any torch in range.
TORCH_PIN ?= torch==2.13.0

.PHONY: install check-native browser test test-fast lint bench clean check-gguf llama-venv check-gpu

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN) || $(BIN)/pip install -q "torch>=2.4,<3"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -m lmcli.model.native build
	@echo "installed: activate with 'source $(VENV)/bin/activate', then run 'lmcli --help'"

# the native kernels' tests under AddressSanitizer and UBSan: the library built with
# -fsanitize=address,undefined (its own cache entry), libasan preloaded into Python
NATIVE_CXX ?= g++
check-native:
	CXX=$(NATIVE_CXX) $(BIN)/python -m lmcli.model.native build --sanitize
	CXX=$(NATIVE_CXX) LMCLI_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 \
		LD_PRELOAD=$$($(NATIVE_CXX) -print-file-name=libasan.so) $(BIN)/python -m pytest tests/model/test_native.py tests/model/test_native_gguf.py tests/model/test_native_layer.py \
		tests/model/test_native_nonfinite.py tests/model/test_quantize.py tests/model/test_native_float.py tests/model/test_kv_blocks.py

# Debian's chromium for the chat page's browser test (tests/serve/test_page.py skips without it)
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
		echo "chromium could not be installed: the browser test will be skipped"

test:
	$(BIN)/python -m pytest tests

# the suite without the end-to-end checks marked slow (each over ~2 s): for the edit-test loop
test-fast:
	$(BIN)/python -m pytest -m "not slow" tests

lint:
	$(BIN)/ruff check lmcli tests bench
	$(BIN)/ruff format --check lmcli tests bench

bench:
	$(BIN)/python -m bench.run

# llama.cpp's own check of `lmcli export --format gguf` (check_gguf.py: llama.cpp reads the files;
# check_quant.py: every preset's tensors byte for byte llama-quantize's): llama-cpp-python is built from its
# source package (the C++ compile takes a while) into a venv outside the project, kept and reused.
# Only llama-cpp-python is built from source: --no-binary :all: would also compile numpy and the
# build tools (cmake, ninja, scikit-build-core). LLAMA_VENV=DIR uses a venv that has llama_cpp.
LLAMA_VENV ?= $(HOME)/.cache/lmcli/llama-venv
LLAMA_CPP_PIN ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF  # the multimodal tools are not needed: half the compile

# The build is smoke-tested (one token from a tiny GGUF file): a CPU that advertises AMX without
# allowing it (some virtual machines) kills ggml's native build in its AMX product; it is then
# rebuilt without -march=native, with the instruction sets the CPU lists and AMX off (no pip cache:
# the cached wheel is the broken one).
LLAMA_PEER := $(BIN)/python tests/formats/llama_peer.py
llama-venv:
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -c "import llama_cpp" 2>/dev/null || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" nice -n 10 $(LLAMA_VENV)/bin/pip install --no-binary llama-cpp-python "$(LLAMA_CPP_PIN)"
	$(LLAMA_PEER) --llama-python $(LLAMA_VENV)/bin/python || { \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$($(LLAMA_PEER) --portable-flags)" nice -n 10 $(LLAMA_VENV)/bin/pip install \
			--no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python "$(LLAMA_CPP_PIN)" && \
		$(LLAMA_PEER) --llama-python $(LLAMA_VENV)/bin/python; }

check-gguf: llama-venv
	$(BIN)/python tests/formats/check_gguf.py --llama-python $(LLAMA_VENV)/bin/python
	$(BIN)/python tests/formats/check_quant.py --llama-python $(LLAMA_VENV)/bin/python

# lmcli's CUDA paths on this machine's GPU (~10 min): GPT-2-small training with --compile (tokens/s,
# MFU, peak memory vs the pre-flight estimate), NCCL torchrun + resume, eval/sample/beam in bf16
# against transformers, sliding windows (SDPA, FlexAttention), 16-bit and block KV caches, DPO,
# GRPO, distillation; one JSON in bench/results/check_gpu.json. Without a GPU: says so, exit 0.
check-gpu:
	$(BIN)/python -m bench.check_gpu

clean:
	rm -rf .pytest_cache build *.egg-info
