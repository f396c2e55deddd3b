"""lmcli's quantizer (native/quantize.cpp through ``quantize_blocks``): the bytes of every format
with and without importance weights against digests of ggml's own output on a fixed input
(``ggml_quantize_chunk`` of llama.cpp's libggml-base, ``make check-gguf`` compares whole models),
the 32-value formats against the gguf package's numpy quantizer, round trips within each format's
error, importance weights lowering the weighted error, threads not changing a byte, and the
one-line refusals (a row that is no whole number of blocks, no native library)."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import torch

from lmcli.errors import LmcliError
from lmcli.model.native import blocks, ops
from lmcli.model.native.blocks import WRITES, quantize_blocks

pytestmark = pytest.mark.skipif(not ops.available(), reason="native library not built here")

QT = gguf.GGMLQuantizationType


def golden_input(n: int, k: int) -> np.ndarray:
    """(n, k) float32 from integer hashing and exact float64 arithmetic (the same on every
    machine): heavy-tailed values, an all-zero row, a zero block, a row of positive values."""
    i = np.arange(n * k, dtype=np.uint64)
    h = (i * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)) >> np.uint64(40)
    t = 2 * ((h & np.uint64(0xFFFFFF)).astype(np.float64) / 2**24) - 1
    v = (t / (1.001 - np.abs(t)) * 0.01).reshape(n, k)
    v[1] = 0
    v[2, :64] = 0
    v[3] = np.abs(v[3])
    return v.astype(np.float32)


def golden_weights(k: int) -> np.ndarray:
    """(k,) importance weights, every seventh column 0."""
    i = np.arange(k, dtype=np.uint64)
    h = (i * np.uint64(2862933555777941757) + np.uint64(3037000493)) >> np.uint64(40)
    w = ((h & np.uint64(0xFFFF)).astype(np.float64) / 2**16) ** 3 * 10
    w[::7] = 0
    return w.astype(np.float32)


# sha256 (first 16 hex digits) of ggml_quantize_chunk(type, golden_input(6, 512), imatrix or
# NULL) from llama.cpp's libggml-base (llama-cpp-python 0.3.36, x86-64)
GGML_DIGESTS = {
    ("q4_0", False): "94739630040597b6",
    ("q4_0", True): "18b33acdf1a39b69",
    ("q4_1", False): "2ebf284d3a1c8ae3",
    ("q4_1", True): "680633ab242c9232",
    ("q5_0", False): "2c6f8e329379580e",
    ("q5_0", True): "9b16c4910d971209",
    ("q5_1", False): "e8ab04e324156c02",
    ("q5_1", True): "1754187a06ac6905",
    ("q8_0", False): "5e8968898152ea3f",
    ("q8_0", True): "5e8968898152ea3f",
    ("q2_K", False): "450f3338f820aba2",
    ("q2_K", True): "9fc38f95938063cd",
    ("q3_K", False): "7f8ddfd0a093ea37",
    ("q3_K", True): "ad03b9934d6a99ad",
    ("q4_K", False): "d356e80caa18e6a2",
    ("q4_K", True): "4ba7bd3489e79ffb",
    ("q5_K", False): "72b20ac605d6603b",
    ("q5_K", True): "9147e39287b7980a",
    ("q6_K", False): "614fb6de5bed09da",
    ("q6_K", True): "d6d93cc427429fb4",
    ("iq4_nl", False): "0fc6a2757f823711",
    ("iq4_nl", True): "ee89726db50be221",
    ("iq4_xs", False): "18b268f580bb3eb6",
    ("iq4_xs", True): "9aabd39fcae60fe3",
}

# the relative RMS error of a round trip of Gaussian weights stays below (measured ~0.75x these)
ROUND_TRIP = {
    "q8_0": 0.007,
    "q4_0": 0.11,
    "q4_1": 0.10,
    "q5_0": 0.055,
    "q5_1": 0.05,
    "q2_K": 0.38,
    "q3_K": 0.19,
    "q4_K": 0.09,
    "q5_K": 0.046,
    "q6_K": 0.023,
    "iq4_nl": 0.095,
    "iq4_xs": 0.095,
}


def dequantized(b: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(b.numpy(), QT[fmt.upper()])).float()


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("fmt", WRITES)
def test_bytes_are_ggmls(fmt: str, weighted: bool) -> None:
    x = torch.from_numpy(golden_input(6, 512))
    qw = torch.from_numpy(golden_weights(512)) if weighted else None
    out = quantize_blocks(x, fmt, qw)
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16] == GGML_DIGESTS[fmt, weighted]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_32_value_formats_equal_gguf_numpy_quantizer(fmt: str) -> None:
    w = torch.randn(40, 320, generator=torch.Generator().manual_seed(3)) * 0.05
    w[0, :32] = 0  # an all-zero block
    w[1, 7] = -w[1].abs().max() * 3  # a negative peak
    w[2] = w[2].abs()  # a block of positive values (the _1 formats' minimum)
    assert np.array_equal(quantize_blocks(w, fmt).numpy(), gguf.quants.quantize(w.numpy(), QT[fmt.upper()]))


@pytest.mark.parametrize("fmt", WRITES)
def test_round_trip_error_within_the_formats(fmt: str) -> None:
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    err = dequantized(quantize_blocks(w, fmt), fmt) - w
    assert (err.pow(2).mean() / w.pow(2).mean()).sqrt() < ROUND_TRIP[fmt]
    zero = dequantized(quantize_blocks(torch.zeros(2, 512), fmt), fmt)
    assert torch.equal(zero, torch.zeros(2, 512))  # zeros stay zeros


@pytest.mark.parametrize("fmt", [f for f in WRITES if f != "q8_0"])
def test_importance_weights_lower_the_weighted_error(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 1024, generator=g) * 0.02
    imp = torch.rand(1024, generator=g) ** 4 * 100  # a few columns matter much more

    def weighted_error(qw: torch.Tensor | None) -> float:
        err = dequantized(quantize_blocks(w, fmt, qw), fmt) - w
        return (err.pow(2) * imp).sum().item()

    assert weighted_error(imp) < 0.9 * weighted_error(None)


def test_threads_and_chunks_do_not_change_a_byte(monkeypatch) -> None:
    w = torch.randn(37, 768, generator=torch.Generator().manual_seed(2)).half()  # float16 rows
    qw = torch.rand(768, generator=torch.Generator().manual_seed(5))
    for fmt in ("q4_K", "iq4_xs", "q6_K"):
        one = quantize_blocks(w, fmt, qw, threads=1)
        assert torch.equal(quantize_blocks(w.float(), fmt, qw, threads=3), one)
        monkeypatch.setattr(blocks, "NATIVE_CHUNK_VALUES", 768 * 5)  # chunks of 5 rows
        assert torch.equal(quantize_blocks(w, fmt, qw, threads=2), one)
        monkeypatch.undo()


def test_refusals() -> None:
    with pytest.raises(LmcliError, match="multiple of 256"):
        quantize_blocks(torch.randn(4, 320), "q4_K")
    with pytest.raises(LmcliError, match="multiple of 32"):
        quantize_blocks(torch.randn(4, 40), "iq4_nl")
    with pytest.raises(LmcliError, match="importance weights"):
        quantize_blocks(torch.randn(4, 256), "q4_K", torch.ones(128))
    with pytest.raises(LmcliError, match="not 'q1_0'"):
        quantize_blocks(torch.randn(4, 256), "q1_0")


def test_without_the_library_k_quants_say_so_and_q8_0_still_writes(monkeypatch) -> None:
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    native = {fmt: quantize_blocks(w, fmt) for fmt in ("q8_0", "q4_0")}
    try:
        monkeypatch.setenv("LMCLI_NATIVE", "0")
        ops._load.cache_clear()
        with pytest.raises(LmcliError, match="writing q4_K blocks needs lmcli's native library"):
            quantize_blocks(w, "q4_K")
        with pytest.raises(LmcliError, match="native library"):
            quantize_blocks(w, "q4_0", torch.ones(256))
        for fmt, ours in native.items():  # torch's code: the same bytes
            assert torch.equal(quantize_blocks(w, fmt), ours)
    finally:
        ops._load.cache_clear()
