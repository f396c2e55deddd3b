"""A KV cache of ggml's blocks (``--kv-dtype q8_0|q4_0``, llama.cpp's ``--cache-type-k/-v``):
each head's row of keys or values rounded to 32-value blocks as it is written, byte for byte
ggml's reference quantizer, by torch (a forward, the per-operation step) and by the native step
alike; the native step's attention over the blocks equals attention over their dequantized
values (the reference a forward computes), for every window, ring and padding; memory 34/32
bytes a value (q8_0) and 18/32 (q4_0); the option reaches every decoding command, and a model
whose heads are no multiple of 32 values is refused in one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, make_run, run_cli, tiny_model
from test_native_layer import LLAMA, assert_close_steps, spread, steps
from test_sliding_window import VARIANTS

from lmcli.cli.common import load_source
from lmcli.errors import LmcliError
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache, kv_bytes, value_bytes
from lmcli.model.native import ops
from lmcli.model.small_blocks import dequantize_rows, quantize_rows

FORMATS = ("q8_0", "q4_0")
native = pytest.mark.skipif(not ops.available(), reason="native kernels not built here")
# head size 32: whole blocks; a Gemma-3-like windowed model (soft-capped, sandwich norms, QK-norm)
MODELS = {
    "llama": dict(n_layer=2, **{**LLAMA, "head_size": 32}),
    "windowed": {**VARIANTS, "head_size": 32, "n_embd": 64},
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_ggml_reference_bytes_and_read_back_as_its_values(fmt: str) -> None:
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, :32] = 0  # an all-zero block: scale 0
    b = quantize_rows(x, fmt)  # (5, 3, 2 blocks of bytes)
    kind = gguf.GGMLQuantizationType[fmt.upper()]
    theirs = gguf.quants.quantize(x.reshape(-1, 64).numpy(), kind)
    assert b.shape == (5, 3, 2 * gguf.GGML_QUANT_SIZES[kind][1])
    assert np.array_equal(b.reshape(15, -1).numpy(), theirs)
    values = torch.from_numpy(gguf.quants.dequantize(theirs, kind)).reshape(5, 3, 64)
    assert torch.equal(dequantize_rows(b, fmt, 64), values)


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_native_step_writes_the_bytes_torch_writes(fmt: str, monkeypatch) -> None:
    """Layer 0's new keys and values do not depend on the cache's type (its input is the
    embedding): the native step's q8_0/q4_0 rows are torch's quantizer's of its float32 rows."""
    model = spread(tiny_model(vocab_size=80, **MODELS["llama"]))
    idx = torch.randint(0, 80, (2, 7), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1")
    caches = {}
    with torch.inference_mode(), fastpath.inference(model):
        for dtype in (torch.float32, fmt):
            caches[dtype] = KVCache.for_model(model, 2, dtype=dtype)
            for t in range(idx.size(1)):
                model.fast_step(idx[:, t : t + 1], caches[dtype])
    wide, narrow = caches[torch.float32], caches[fmt]
    assert narrow.fmt == fmt and narrow.k.dtype == torch.uint8
    for a, b in ((wide.k, narrow.k), (wide.v, narrow.v)):
        assert torch.equal(quantize_rows(a[0, :, :, :7], fmt), b[0, :, :, :7])


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    "cache", [{}, {"window_slack": 2}, {"start": torch.tensor([0, 3])}], ids=["plain", "ring", "padded"]
)
def test_the_native_step_attends_over_blocks_as_over_their_values(
    fmt: str, name: str, cache, monkeypatch
) -> None:
    """The one-call step reading the blocks against the per-operation step, which dequantizes the
    cache and attends over the values (within the float rounding of the two orders of sums)."""
    model = spread(tiny_model(vocab_size=80, **MODELS[name]))
    idx = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(2))
    got = steps(model, idx, True, monkeypatch, dtype=fmt, **cache)
    assert_close_steps(got, steps(model, idx, False, monkeypatch, dtype=fmt, **cache))


@pytest.mark.parametrize("slack", [None, 0], ids=["no-ring", "ring"])
def test_the_blocks_take_their_bytes_and_the_estimate_counts_them(slack: int | None) -> None:
    model = tiny_model(vocab_size=80, **MODELS["windowed"])
    sizes = {}
    for dtype in (torch.float32, *FORMATS):
        model.kv_dtype = dtype
        cache = KVCache.for_model(model, 3, window_slack=slack)
        cache.reserve(model.config.block_size)
        sizes[dtype] = cache.nbytes()
        assert kv_bytes(model.config, model.config.block_size, value_bytes(dtype), slack) * 3 == sizes[dtype]
    assert sizes["q8_0"] * 4 * 32 == sizes[torch.float32] * 34
    assert sizes["q4_0"] * 4 * 32 == sizes[torch.float32] * 18


def test_the_option_reaches_the_commands_and_heads_of_other_sizes_are_refused(tmp_path, capsys) -> None:
    run = make_run(tmp_path / "run", position="rope", norm="rmsnorm", mlp="swiglu", n_head=1, n_embd=32)
    assert load_source(run, {"kv_dtype": "q8_0"}).model.kv_dtype == "q8_0"
    for fmt in FORMATS:
        argv = ["sample", str(run), "-p", "the", "--max-new-tokens", "12", "--kv-dtype", fmt]
        code, out, err = run_cli(argv, capsys)
        assert code == 0 and out.strip(), err
    other = make_run(tmp_path / "other")  # heads of 16 values
    code, _, err = run_cli(["sample", str(other), "-p", "the", "--kv-dtype", "q4_0"], capsys)
    assert_one_line_error(code, err, "--kv-dtype q4_0 keeps each head's keys in blocks of 32 values")
    with pytest.raises(LmcliError, match="heads have 16"):
        KVCache.for_model(tiny_model(), 1, dtype="q8_0")
