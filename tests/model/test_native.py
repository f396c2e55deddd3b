"""The native kernels against gguf's own dequantizers: each format, each instruction set this CPU
runs, batched and threaded forms, the size checks in front of the kernels, the library's report
of itself, and the fallback. Products and dequantizing go through ``ops.BoundProduct``, the entry
``BlockLinear`` and the one-call step's head use."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # gguf_files' block builder
from gguf_files import random_blocks as gguf_random_blocks  # noqa: E402

from lmcli.errors import LmcliError  # noqa: E402
from lmcli.model.native import abi, build, ops  # noqa: E402
from lmcli.model.native.blocks import dequantize_blocks, quantize_blocks  # noqa: E402
from lmcli.model.quant import BlockLinear  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.available(), reason="native kernels not built here")

QT = gguf.GGMLQuantizationType


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, row bytes) uint8: from gguf's own quantizer where it has one, else random valid blocks
    (random bits with finite fp16 scales, one a block: gguf has no K-quant or IQ quantizer)."""
    rng = np.random.default_rng(seed)
    f = ops.FORMATS[fmt]
    if fmt != "iq4_nl" and f.block == 32:  # (gguf quantizes every 32-value format but iq4_nl)
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return gguf.quants.quantize(w, QT[fmt.upper()])
    d = rng.random(n * k // f.block) * 2e-3 + 1e-4
    return gguf_random_blocks(fmt.upper(), n, k, rng, d)


def product(
    x: Tensor, blocks: np.ndarray | Tensor, fmt: str, k: int, threads: int = 1, isa: str | None = None
) -> Tensor:
    """x @ W.T through the production entry: the blocks bound once, the input checked a call."""
    return ops.BoundProduct(torch.as_tensor(blocks), fmt, k, isa)(x, threads)


def dequantized(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return gguf.quants.dequantize(blocks, QT[fmt.upper()]).astype(np.float64)


def quantized_activations(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded as the kernels round it: int8 per block, scale max|x| / 127 (float32 arithmetic)."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, block)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


FMTS = list(ops.FORMATS)


@pytest.mark.parametrize("fmt", FMTS)
def test_product_equals_dequantized_weights(fmt: str) -> None:
    n, k, m = 37, 512, 3
    f = ops.FORMATS[fmt]
    blocks = random_blocks(fmt, n, k)
    w = dequantized(blocks, fmt)  # (n, k) gguf's reading of the same bytes
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    # against the activations rounded as the kernel rounds them: float32 summation order only
    xq = quantized_activations(x, f.block)
    scale = np.abs(xq) @ np.abs(w).T
    for isa in ops.library().isas:
        y = product(torch.from_numpy(x), blocks, fmt, k, isa=isa).double().numpy()
        np.testing.assert_array_less(np.abs(y - xq @ w.T), 1e-5 * scale + 1e-30, err_msg=isa)
    # against float activations: within the rounding of the activations (half a step a value)
    step = np.repeat(np.abs(x).reshape(m, -1, f.block).max(-1) / 127, f.block, axis=1)
    bound = (step / 2) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(y - x.astype(np.float64) @ w.T), bound * (1 + 1e-4) + 1e-6 * scale)
    assert np.abs(y - x @ w.T).max() < 0.02 * np.abs(x @ w.T).max()


@pytest.mark.parametrize("fmt", FMTS)
def test_every_instruction_set_equals_scalar(fmt: str) -> None:
    n, k = 33, 3 * ops.FORMATS[fmt].block
    blocks = torch.from_numpy(random_blocks(fmt, n, k, seed=2))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    ref = product(x, blocks, fmt, k, isa="scalar").double()
    scale = x.abs() @ torch.from_numpy(np.abs(dequantized(blocks.numpy(), fmt))).T.float()
    lib = ops.library()
    assert lib is not None and "scalar" in lib.isas
    for isa in lib.isas:
        y = product(x, blocks, fmt, k, isa=isa).double()
        assert ((y - ref).abs() <= 1e-5 * scale.double() + 1e-30).all(), isa


@pytest.mark.parametrize("fmt", FMTS)
def test_batched_and_threaded_equal_one_row_at_a_time(fmt: str) -> None:
    n, k = 45, 512
    blocks = torch.from_numpy(random_blocks(fmt, n, k, seed=4))
    x = torch.randn(2, 9, k, generator=torch.Generator().manual_seed(5))
    batched = product(x, blocks, fmt, k, threads=3)
    assert batched.shape == (2, 9, n)
    rows = torch.stack([product(r, blocks, fmt, k) for r in x.reshape(-1, k)]).reshape(2, 9, n)
    assert torch.equal(batched, rows)  # each output is the same dot product, whatever the split
    assert torch.equal(product(x, blocks, fmt, k, threads=64), batched)  # more threads than rows


# ----------------------------------------------------------------------------- a prompt's GEMM


def gguf_bfloat16(blocks: np.ndarray, fmt: str) -> Tensor:
    """gguf's float32 reading of ``blocks``, rounded to bfloat16 by torch (the reference)."""
    with np.errstate(all="ignore"):  # random bytes: NaN and infinite scales too
        w = gguf.quants.dequantize(blocks, QT[fmt.upper()]).astype(np.float32)
    return torch.from_numpy(w).bfloat16()


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_equals_gguf_bit_for_bit(fmt: str) -> None:
    """Every byte pattern (random blocks: subnormal, zero, infinite and NaN scales among them) reads
    as gguf's float32 values rounded to bfloat16 as torch rounds, on every instruction set."""
    f = ops.FORMATS[fmt]
    n, k = 67, 3 * f.block
    raw = np.random.default_rng(11).integers(0, 256, (n, f.row_bytes(k)), dtype=np.uint8)
    good = random_blocks(fmt, n, k, seed=12)
    for blocks in (raw, good):
        ref = gguf_bfloat16(blocks, fmt)
        nan = ref.isnan()  # (torch's own NaN bits differ between its loops: NaN is all that is asked)
        for isa in ops.library().isas:
            for threads in (1, 3):
                got = ops.BoundProduct(torch.from_numpy(blocks), fmt, k, isa).weight(threads)
                assert got.dtype == torch.bfloat16 and got.shape == (n, k)
                assert torch.equal(got.isnan(), nan), (isa, threads)
                assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan]), (isa, threads)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_0", "q4_K", "q6_K"])
def test_gemm_equals_bfloat16_product_in_slices(fmt: str) -> None:
    """A prompt's product: the bfloat16 weight times bfloat16 activations, whole or a few rows of
    the weight at a time (a vocabulary head's slices), as torch multiplies them."""
    n, k = 45, 512
    blocks = torch.from_numpy(random_blocks(fmt, n, k, seed=13))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(14))
    ref = F.linear(x.bfloat16(), gguf_bfloat16(blocks.numpy(), fmt))  # (m, n)
    bound = ops.BoundProduct(blocks, fmt, k)
    whole = bound.gemm(x, 1)
    assert whole.dtype == torch.bfloat16 and whole.shape == (40, n)
    assert torch.equal(whole, ref)
    for chunk, threads in ((7 * k, 1), (16 * k, 2), (k, 3)):  # 7 rows a slice (the last 3), 16, 1
        torch.testing.assert_close(bound.gemm(x, threads, chunk_values=chunk), ref, rtol=1e-2, atol=1e-3)
    exact = F.linear(x.double(), torch.from_numpy(dequantized(blocks.numpy(), fmt)))
    torch.testing.assert_close(whole.double(), exact, rtol=0.02, atol=0.02 * exact.abs().max().item())


def test_gemm_inside_and_outside_inference_mode_and_under_autograd() -> None:
    """The thread's bfloat16 buffer, first made under inference_mode, serves outside it; a product
    autograd records keeps a weight of its own (a later product does not overwrite it)."""
    k, n = 256, 30
    blocks = torch.from_numpy(random_blocks("q8_0", n, k, seed=15))
    bound = ops.BoundProduct(blocks, "q8_0", k)
    other = ops.BoundProduct(torch.from_numpy(random_blocks("q8_0", n, k, seed=16)), "q8_0", k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(17))
    with torch.inference_mode():
        inside = bound.gemm(x, 1)
    assert torch.equal(bound.gemm(x, 1), inside)
    xg = x.clone().requires_grad_()
    y = bound.gemm(xg, 1)
    other.gemm(x, 1)  # the thread's buffer now holds the other weight
    (y.float() * torch.arange(float(n))).sum().backward()
    xr = x.clone().requires_grad_()
    w = gguf_bfloat16(blocks.numpy(), "q8_0")
    (F.linear(xr.bfloat16(), w).float() * torch.arange(float(n))).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


def test_threads_are_distinct() -> None:
    lib = ops.library().lib
    assert [lib.lmcli_native_pool_threads(t) for t in (1, 3, 2, 5)] == [1, 3, 2, 5]


def test_zero_and_huge_activations() -> None:
    k = 64
    blocks = torch.from_numpy(random_blocks("q8_0", 4, k))
    assert torch.equal(product(torch.zeros(1, k), blocks, "q8_0", k), torch.zeros(1, 4))
    x = torch.zeros(1, k)
    x[0, 3] = 1e30  # one huge value: its block's scale is huge, the rest of the row is unaffected
    y = product(x, blocks, "q8_0", k)
    w = dequantized(blocks.numpy(), "q8_0")
    np.testing.assert_allclose(y[0].double().numpy(), 1e30 * w[:, 3], rtol=1e-5)


def test_bad_sizes_are_refused() -> None:
    """Every size, dtype, layout and argument the library would trust is checked before it: when
    the blocks are bound (once a layer), and at each call (products, dequantizing, prompts)."""
    k = 64
    blocks = torch.from_numpy(random_blocks("q8_0", 4, k))
    bound = ops.BoundProduct(blocks, "q8_0", k)
    x = torch.randn(2, k)
    bad = [
        lambda: ops.BoundProduct(blocks, "q8_0", 48),  # k does not match the row bytes
        lambda: ops.BoundProduct(blocks, "q8_0", 65),  # k not a multiple of the block
        lambda: ops.BoundProduct(blocks[:, :-1], "q8_0", k),  # truncated rows
        lambda: ops.BoundProduct(blocks.reshape(-1), "q8_0", k),  # not 2-D
        lambda: ops.BoundProduct(blocks.view(torch.int8), "q8_0", k),  # wrong dtype
        lambda: ops.BoundProduct(torch.cat([blocks, blocks], 1)[:, ::2], "q8_0", k),  # not contiguous
        lambda: ops.BoundProduct(blocks, "iq2_xxs", k),  # no kernel for the format
        lambda: ops.BoundProduct(blocks, "q4_K", k),  # a K-quant needs 256-value rows
        lambda: ops.BoundProduct(blocks, "q8_0", k, isa="sse9"),
        lambda: ops.BoundProduct(
            torch.zeros(35, dtype=torch.uint8)[1:].view(1, 34), "q8_0", 32
        ),  # odd address
        lambda: bound(x[:, :32]),  # inputs of the wrong width
        lambda: bound(x.long()),  # integer inputs
        lambda: bound(x, threads=0),
        lambda: bound.weight(threads=0),
        lambda: bound.gemm(torch.randn(40, k + 32), 1),  # inputs of the wrong width
        lambda: bound.gemm(torch.randn(40, k).long(), 1),  # integer inputs
        lambda: bound.gemm(torch.randn(2, 20, k), 1),  # not (m, k)
        lambda: bound.gemm(torch.randn(40, k), 0),
    ]
    for fmt in ("q4_1", "q5_0", "q5_1"):  # the 32-value formats with a min or a fifth bit
        b = torch.from_numpy(random_blocks(fmt, 4, k))
        bad += [
            lambda b=b, fmt=fmt: ops.BoundProduct(b, fmt, 48),  # k does not match the row bytes
            lambda b=b, fmt=fmt: ops.BoundProduct(b[:, : len(b[0]) * 3 // 4], fmt, 48),  # 1.5 blocks
            lambda b=b, fmt=fmt: ops.BoundProduct(b[:, :-1].contiguous(), fmt, k),  # truncated rows
            lambda b=b: ops.BoundProduct(b, "q8_0", k),  # another format's row bytes
        ]
    for i, call in enumerate(bad):
        with pytest.raises(LmcliError):
            call()
            pytest.fail(f"case {i} was not refused")
    # (..., k) inputs of any float dtype are reshaped and converted
    x3 = torch.randn(2, 3, k, dtype=torch.float64)
    assert torch.equal(bound(x3), bound(x3.reshape(6, k).float()).reshape(2, 3, 4))


def test_the_library_reports_what_lmcli_binds() -> None:
    """The library's own report (abi.h, formats.h): its version, the names Python uses by number,
    every structure field at the offset and size of ctypes' mirror, and a block table equal to
    gguf's sizes for the formats lmcli runs."""
    lib = ops.library()
    report = lib.report
    assert lib.lib.lmcli_native_version() == abi.VERSION
    assert report.isas[:4] == ("scalar", "avx2", "avx_vnni", "avx512_vnni") and "neon_dotprod" in report.isas
    assert report.acts == ("silu", "gelu_tanh")
    assert report.cache_types == ("float32", "bfloat16", "float16", "q8_0", "q4_0")
    assert lib.best in lib.isas
    runs = {name for name, f in report.formats.items() if f.products}
    assert runs == set(ops.FORMATS) | {"f32", "f16", "bf16"}
    for name, f in report.formats.items():
        kind = QT[name.upper()]
        assert (f.ggml_type, (f.block, f.block_bytes)) == (kind, gguf.GGML_QUANT_SIZES[kind]), name
    assert {n for n in ("f32", "f16", "bf16") if n in report.formats} == {"f32", "f16", "bf16"}


class _Lying:
    """A library whose report differs from the real one in one answer."""

    def __init__(self, real: ctypes.CDLL, name: str, fn) -> None:
        self.real, self.name, self.fn = real, name, fn

    def __getattr__(self, attr: str):
        return self.fn if attr == self.name else getattr(self.real, attr)


def test_a_library_that_does_not_fit_is_refused_in_one_line(monkeypatch) -> None:
    """Another version, a structure laid out otherwise, a block of another size: the library is
    refused with one line naming the difference, and products take torch's path."""
    real = ops.library().lib
    fields = real.lmcli_native_field

    def moved(i, kind, field, offset, size):  # LmLayer's first field 8 bytes further on
        rc = fields(i, kind, field, offset, size)
        if rc == 0 and kind.value == b"LmLayer" and field.value == b"C":
            offset.value += 8
        return rc

    fmt = real.lmcli_native_format

    def other_size(i, t, name, block, size, align, products):
        rc = fmt(i, t, name, block, size, align, products)
        if rc == 0 and name.value == b"q4_K":
            size.value = 145
        return rc

    cases = [
        ("lmcli_native_version", lambda: abi.VERSION + 1, "version"),
        ("lmcli_native_field", moved, "LmLayer.C"),
        ("lmcli_native_format", other_size, "q4_K"),
    ]
    for name, fn, says in cases:
        lying = _Lying(real, name, fn)
        monkeypatch.setattr(ops.ctypes, "CDLL", lambda path, lying=lying: lying)
        with pytest.raises(LmcliError) as e:
            ops._open(Path("liblmcli_native-x.so"))
        assert "does not fit lmcli" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


CROSS = ("aarch64-linux-gnu-g++", "qemu-aarch64")


@pytest.mark.skipif(not all(map(shutil.which, CROSS)), reason="no aarch64 cross compiler and qemu-user")
def test_neon_dotprod_equals_scalar_under_qemu(tmp_path) -> None:
    """The aarch64 path (NEON sdot), cross-compiled and run on an emulated CPU with dotprod."""
    exe = tmp_path / "isa_check"
    units = [p for p in build.sources() if p.suffix == ".cpp"]  # the library's translation units
    src = [Path(__file__).with_name("native_isa_check.cpp"), *units]
    include = f"-I{Path(ops.__file__).parent}"
    cmd = [CROSS[0], "-O2", "-std=c++17", "-pthread", "-static", include, "-o", str(exe), *map(str, src)]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # make check-native's libasan
    subprocess.run(cmd, check=True, timeout=300, env=env)
    out = subprocess.run(
        [CROSS[1], "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stdout
    assert out.stdout.count("neon_dotprod ok") == len(ops.FORMATS)
    for fmt, f in ops.FORMATS.items():  # a prompt's dequantize there, against gguf's values here
        n, k = 5, 2 * f.block
        blocks = np.random.default_rng(18).integers(0, 256, (n, f.row_bytes(k)), dtype=np.uint8)
        (tmp_path / "in").write_bytes(blocks.tobytes())
        args = ["dequantize", str(f.ggml_type), str(n), str(k), str(tmp_path / "in"), str(tmp_path / "out")]
        run = subprocess.run(
            [CROSS[1], "-cpu", "max", str(exe), *args], capture_output=True, text=True, env=env
        )
        assert run.returncode == 0 and "isa 4" in run.stdout, (fmt, run.stdout)
        got = torch.frombuffer(bytearray((tmp_path / "out").read_bytes()), dtype=torch.bfloat16).reshape(n, k)
        ref = gguf_bfloat16(blocks, fmt)
        assert torch.equal(got.isnan(), ref.isnan()), fmt
        assert torch.equal(got[~ref.isnan()].view(torch.int16), ref[~ref.isnan()].view(torch.int16)), fmt


def test_disabled_or_unbuildable_falls_back_to_torch(tmp_path, monkeypatch) -> None:
    try:
        monkeypatch.setenv("LMCLI_NATIVE", "0")
        ops._load.cache_clear()
        assert not ops.available()
        assert ops.backend_line() == "quantized products: torch (native kernels off (LMCLI_NATIVE=0))"
        with pytest.raises(LmcliError):
            ops.BoundProduct(torch.zeros(1, 34, dtype=torch.uint8), "q8_0", 32)
        monkeypatch.setenv("LMCLI_NATIVE", "1")
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("LMCLI_NATIVE_DIR", str(tmp_path))
        ops._load.cache_clear()
        assert not ops.available()
        line = ops.backend_line()
        assert line.startswith("quantized products: torch (") and "compiler" in line
    finally:
        ops._load.cache_clear()  # the next test loads the real library again


# ----------------------------------------------------------------------------- BlockLinear


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantize_blocks_writes_gguf_bytes(fmt: str) -> None:
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(6)) * 0.1
    w[0, :32] = 0  # an all-zero block
    w[1, 5] = -w[1].abs().max() * 2  # a negative peak (q4_0's scale sign)
    ours = quantize_blocks(w, fmt)
    theirs = gguf.quants.quantize(w.numpy(), QT[fmt.upper()])
    assert np.array_equal(ours.numpy(), theirs)
    np.testing.assert_array_equal(
        dequantize_blocks(ours, fmt, 96).numpy(), gguf.quants.dequantize(theirs, QT[fmt.upper()])
    )


@pytest.mark.parametrize("fmt", FMTS)
def test_block_linear_decode_and_prefill(fmt: str) -> None:
    n, k = 24, 512
    blocks = torch.from_numpy(random_blocks(fmt, n, k, seed=7))
    bias = torch.randn(n)
    layer = BlockLinear(blocks, fmt, k, bias)
    assert layer.blocks.untyped_storage().nbytes() == blocks.numel()  # memory = the file's bytes
    w = torch.from_numpy(dequantized(blocks.numpy(), fmt)).float()
    for shape in [(1, 1, k), (2, 17, k)]:  # one row (decode), many (a prompt)
        x = torch.randn(*shape)
        ref = F.linear(x, w, bias)
        y = layer(x)
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    ids = torch.tensor([[3, 0], [23, 3]])
    torch.testing.assert_close(layer.weight_rows(ids), w[ids])


def test_block_linear_prompt_rows_take_a_bfloat16_gemm() -> None:
    from lmcli.model.quant import BLOCK_GEMM_ROWS

    lin = torch.nn.Linear(256, 40)
    layer = BlockLinear.quantized(lin, "q4_0")
    x = torch.randn(BLOCK_GEMM_ROWS + 3, 256)
    w = dequantize_blocks(layer.blocks, "q4_0", 256)
    ref = F.linear(x.double(), w.double(), lin.bias.double())
    y = layer(x)
    torch.testing.assert_close(y.double(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    # exactly torch's bfloat16 product of the bfloat16 weight (the kernels dequantize it)
    assert torch.equal(y, F.linear(x.bfloat16(), w.bfloat16()).float() + lin.bias)
    rows = torch.cat([layer(r) for r in x.split(BLOCK_GEMM_ROWS - 1)])  # the kernels' rows
    torch.testing.assert_close(rows.double(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


def test_block_linear_from_linear_and_fallback(monkeypatch) -> None:
    lin = torch.nn.Linear(64, 10)
    layer = BlockLinear.quantized(lin, "q8_0")
    x = torch.randn(3, 64)
    native = layer(x)
    torch.testing.assert_close(native, lin(x), rtol=0.02, atol=0.02)
    try:
        monkeypatch.setenv("LMCLI_NATIVE", "0")
        ops._load.cache_clear()
        fallback = BlockLinear.quantized(lin, "q8_0")(x)  # dequantized weight, torch's product
        w = dequantize_blocks(layer.blocks, "q8_0", 64)
        torch.testing.assert_close(fallback, F.linear(x, w, lin.bias))
    finally:
        ops._load.cache_clear()
    with pytest.raises(LmcliError):
        BlockLinear(layer.blocks[:, :-2].contiguous(), "q8_0", 64)
    with pytest.raises(LmcliError):
        quantize_blocks(torch.randn(4, 40), "q4_0")


@pytest.mark.parametrize("fmt", list(ops.FORMATS))
def test_weight_rows_are_gguf_values_exactly(fmt: str) -> None:
    """A block embedding's lookups (``BoundProduct.rows``, ``BlockLinear.weight_rows``): rows of
    the table as gguf dequantizes them, bit for bit; an id outside the table is refused."""
    blocks = torch.from_numpy(random_blocks(fmt, 24, 512, seed=7))
    ids = torch.tensor([[5, 0], [23, 5]])
    expected = torch.from_numpy(dequantized(blocks.numpy(), fmt).astype(np.float32)).reshape(24, 512)[ids]
    layer = BlockLinear(blocks, fmt, 512)
    assert torch.equal(layer.weight_rows(ids), expected)  # (2, 2, 512)
    for bad in (torch.tensor([24]), torch.tensor([-1])):
        with pytest.raises(LmcliError, match="ids outside the 24 rows"):
            layer.weight_rows(bad)
