"""The kernels from Python: load the library (building it on first use), check every size, call.

``BoundProduct(blocks, fmt, k)`` is ``x @ W.T`` for W stored as GGUF blocks of format ``fmt``
(``BlockLinear``'s product, the one-call step's head): the blocks are checked once when it is
made, each input when it is called; the rows of ``x`` are quantized to int8 per block (32 values
for the 32-value formats, 256 for the K-quants and iq4_xs), multiplied with integer dot products
and scaled back to float32. Its ``gemm`` (a prompt's product) dequantizes the weight to bfloat16
for torch's GEMM. Nothing reaches the kernel before its shapes, dtypes, contiguity and byte counts
are checked here: the C++ side trusts them.

The formats the kernels run are ``FORMATS``: names, with each block's values and bytes from
gguf's ``GGML_QUANT_SIZES``; when the library loads, its own table (formats.h) must say the same,
or it is refused in one line (and products take torch's path).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model.native import abi, build

# a prompt's product dequantizes the weight to bfloat16 this many values at a time (whole rows):
# one buffer of 8 MB at most, so a vocabulary head's GEMM never holds its whole table in bfloat16
GEMM_CHUNK_VALUES = 1 << 22


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block layout: ``block`` values in ``block_bytes`` bytes; ``ggml_type`` GGML's number."""

    name: str
    ggml_type: int
    block: int
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` values (``k`` a multiple of ``block``)."""
        return k // self.block * self.block_bytes


def _format(name: str) -> BlockFormat:
    kind = gguf.GGMLQuantizationType[name.upper()]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    return BlockFormat(name, int(kind), block, size)


# the block formats the kernels multiply as stored, by ggml's names (formats.h lists them too: the
# library's table is checked against this one when it loads)
NATIVE = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K")
NATIVE += ("iq4_nl", "iq4_xs", "mxfp4")
FORMATS = {name: _format(name) for name in NATIVE}
# float weights (a float32, float16 or bfloat16 tensor's bytes, "blocks" of one value): the
# kernels multiply them too (a decoding step's products; a prompt's are torch's GEMM)
FLOATS = {name: _format(name) for name in ("f32", "f16", "bf16")}
PRODUCTS = {**FORMATS, **FLOATS}
TORCH_FLOATS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass
class Library:
    """The loaded library, where it is, and what it says of itself (``abi.Report``): its
    instruction sets, those this CPU runs, the best of them."""

    lib: ctypes.CDLL
    path: Path
    report: abi.Report
    isas: tuple[str, ...]  # the instruction sets this CPU runs

    @property
    def best(self) -> str:
        return self.report.isas[self.report.best_isa]

    @property
    def best_index(self) -> int:
        return self.report.best_isa

    def isa_index(self, isa: str | None) -> int:
        """The library's number of instruction set ``isa`` (None: the best this CPU runs)."""
        if isa is None:
            return self.report.best_isa
        if isa in self.isas:
            return self.report.isas.index(isa)
        raise LmcliError(f"instruction set {isa!r} is not available (this CPU: {', '.join(self.isas)})")

    @functools.cached_property
    def _scratch(self) -> threading.local:
        return threading.local()

    def gemm_buffer(self, rows: int, k: int) -> Tensor:
        """(rows, k) bfloat16 for a prompt's weight slice: one buffer a calling thread, grown as
        needed and kept (a fresh 8 MB a product costs page faults: ~0.6 ms at 4864 x 896); a
        normal tensor even when made under ``torch.inference_mode`` (it is used outside it too)."""
        buf = getattr(self._scratch, "gemm", None)
        if buf is None or buf.numel() < rows * k:
            with torch.inference_mode(False):
                buf = self._scratch.gemm = torch.empty(rows * k, dtype=torch.bfloat16)
        return buf[: rows * k].view(rows, k)


def _check_formats(report: abi.Report) -> None:
    """Raises LmcliError unless the library multiplies exactly ``PRODUCTS``, with gguf's sizes."""
    runs = {name for name, f in report.formats.items() if f.products}
    if runs != set(PRODUCTS):
        raise LmcliError(f"it runs {', '.join(sorted(runs ^ set(PRODUCTS)))} otherwise than lmcli expects")
    for name, f in report.formats.items():
        kind = getattr(gguf.GGMLQuantizationType, name.upper(), None)
        sizes = gguf.GGML_QUANT_SIZES.get(kind) if kind is not None else None
        if (f.ggml_type, (f.block, f.block_bytes)) != (kind, sizes):
            raise LmcliError(
                f"its {name} is type {f.ggml_type}, {f.block} values in {f.block_bytes} bytes; gguf's {sizes}"
            )


def _open(path: Path) -> Library:
    lib = ctypes.CDLL(str(path))
    try:
        report = abi.bind(lib)
        _check_formats(report)
    except LmcliError as e:
        raise LmcliError(f"native kernels: {path.name} does not fit lmcli: {e}") from None
    isas = tuple(name for n, name in enumerate(report.isas) if lib.lmcli_native_supported(n))
    return Library(lib, path, report, isas)


@functools.cache
def _load() -> tuple[Library | None, str]:
    """(the library or None, why not), once a process; ``LMCLI_NATIVE=0`` turns it off,
    ``LMCLI_NATIVE_SANITIZE=1`` loads the AddressSanitizer build (``make check-native``)."""
    if os.environ.get("LMCLI_NATIVE", "1") == "0":
        return None, "off (LMCLI_NATIVE=0)"
    try:
        path = build.build(sanitize=os.environ.get("LMCLI_NATIVE_SANITIZE") == "1")
        return _open(path), ""
    except LmcliError as e:
        return None, str(e).removeprefix("native kernels: ")
    except OSError as e:  # a library that does not load (another machine's, a broken file)
        return None, f"the library does not load ({e})"


def library() -> Library | None:
    """The kernels' library, or None where it cannot be built or loaded (or is turned off)."""
    return _load()[0]


def available() -> bool:
    return library() is not None


def backend_line() -> str:
    """One line naming the path quantized products take, for --verbose and the pre-flight."""
    lib, why = _load()
    if lib is None:
        return f"quantized products: torch (native kernels {why})"
    return f"quantized products: native kernels, {lib.best} ({', '.join(lib.isas)} on this CPU)"


def _loaded() -> Library:
    lib = library()
    if lib is None:
        raise LmcliError(f"native kernels are not available: {_load()[1]}")
    return lib


def check_blocks(blocks: Tensor, fmt: str, k: int) -> BlockFormat:
    """The format of ``blocks`` after checking it holds whole rows of ``k`` values in ``fmt`` (a
    block format, or a float one: ``float_blocks``)."""
    if fmt not in PRODUCTS:
        raise LmcliError(f"block format {fmt!r} has no native kernel (have: {', '.join(PRODUCTS)})")
    f = PRODUCTS[fmt]
    if not isinstance(k, int) or k <= 0 or k % f.block:
        raise LmcliError(f"{fmt} rows of {k} values: the width must be a positive multiple of {f.block}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device.type != "cpu":
        raise LmcliError(
            f"{fmt} blocks must be a 2-D uint8 CPU tensor, not {blocks.dtype} {tuple(blocks.shape)}"
        )
    if blocks.size(1) != f.row_bytes(k):
        raise LmcliError(
            f"{fmt} rows of {k} values take {f.row_bytes(k)} bytes, the blocks have {blocks.size(1)} a row"
        )
    if not blocks.is_contiguous():
        raise LmcliError(f"{fmt} blocks must be contiguous")
    storage = blocks.untyped_storage().nbytes() - blocks.storage_offset()
    if storage < blocks.numel():
        raise LmcliError(f"{fmt} blocks: {blocks.numel()} bytes expected, the buffer holds {storage}")
    return f


def float_blocks(weight: Tensor) -> tuple[Tensor, str]:
    """A float weight (n, k) as the kernels read it: its bytes (n, k * itemsize) uint8, a view
    (no copy), and its format ("f32", "f16", "bf16")."""
    fmt = TORCH_FLOATS.get(weight.dtype)
    if fmt is None or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise LmcliError(
            f"a float product needs a contiguous (n, k) float32, float16 or bfloat16 CPU weight, not "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    return weight.detach().view(torch.uint8), fmt


def _check_threads(threads: int) -> None:
    if type(threads) is not int or threads < 1:
        raise LmcliError(f"threads must be a positive integer, not {threads!r}")


class BoundProduct:
    """The product of one blocks tensor, checked once (``check_blocks``) and what can be computed
    once computed once: a decode step calls ~7 products a layer, each a few microseconds of Python
    otherwise. ``isa`` forces an instruction set (default: the best this CPU has)."""

    def __init__(self, blocks: Tensor, fmt: str, k: int, isa: str | None = None) -> None:
        lib = _loaded()
        self.format = check_blocks(blocks, fmt, k)
        align = lib.report.formats[fmt].align  # (the kernels read a block's fields as its struct's)
        if blocks.data_ptr() % align:
            raise LmcliError(f"{fmt} blocks must start at a multiple of {align} bytes")
        self.blocks, self.k, self.n = blocks, k, blocks.size(0)  # (blocks kept alive)
        self.lib, self.fn, self.isa = lib, lib.lib.lmcli_native_matmul, lib.isa_index(isa)
        self.dequant = lib.lib.lmcli_native_dequantize
        self.ptr = blocks.data_ptr()

    def __call__(self, x: Tensor, threads: int = 1) -> Tensor:
        """x (..., k) float CPU -> (..., n) float32; ``threads`` share W's rows. (m, k) float32
        contiguous rows (a decode step's) go straight to the kernel; any other x is checked,
        reshaped and converted first."""
        if (
            x.dtype is not torch.float32
            or x.dim() != 2
            or x.size(1) != self.k
            or not x.is_cpu
            or not x.is_contiguous()
        ):
            if not x.is_floating_point() or not x.is_cpu or x.dim() < 1 or x.size(-1) != self.k:
                what = f"{x.dtype} {tuple(x.shape)}"
                raise LmcliError(
                    f"{self.format.name} product: inputs must be float CPU (..., {self.k}), not {what}"
                )
            x2 = x.reshape(-1, self.k).to(torch.float32).contiguous()  # (..., k) -> (m, k)
            return self(x2, threads).reshape(*x.shape[:-1], self.n)
        _check_threads(threads)
        y = torch.empty(x.size(0), self.n)  # (m, n) float32
        rc = self.fn(
            self.format.ggml_type,
            self.ptr,
            self.n,
            self.k,
            x.data_ptr(),
            x.size(0),
            y.data_ptr(),
            threads,
            self.isa,
        )
        if rc != 0:
            raise LmcliError(f"native {self.format.name} product refused its sizes (n={self.n}, k={self.k})")
        return y

    def _dequantize(self, first: int, rows: int, out: Tensor, threads: int) -> None:
        """Weight rows first..first + rows into ``out`` (rows, k) bfloat16, by the kernels."""
        w = self.ptr + first * self.format.row_bytes(self.k)
        if self.dequant(self.format.ggml_type, w, rows, self.k, out.data_ptr(), threads, self.isa) != 0:
            raise LmcliError(f"native {self.format.name} dequantize refused its sizes (n={rows}, k={self.k})")

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (n,) of the weight as float32 (n, k): gguf's dequantized values, exactly
        (a token embedding's lookups in a table of blocks)."""
        ids = ids.to(torch.int64).contiguous()
        if ids.dim() != 1 or not ids.is_cpu:
            raise LmcliError(f"weight rows: ids must be a 1-D CPU tensor, not {tuple(ids.shape)}")
        out = torch.empty(ids.numel(), self.k)  # (n, k)
        rc = self.lib.lib.lmcli_native_weight_rows(
            self.format.ggml_type, self.ptr, self.n, self.k, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        if rc != 0:
            raise LmcliError(f"weight rows: ids outside the {self.n} rows of this {self.format.name} weight")
        return out

    def weight(self, threads: int = 1) -> Tensor:
        """The (n, k) weight in bfloat16 as a prompt's GEMM reads it: bit for bit
        ``native.blocks.dequantize_blocks(...).bfloat16()`` (a NaN may differ in its bits)."""
        _check_threads(threads)
        out = torch.empty(self.n, self.k, dtype=torch.bfloat16)
        self._dequantize(0, self.n, out, threads)
        return out

    def gemm(self, x: Tensor, threads: int, chunk_values: int = GEMM_CHUNK_VALUES) -> Tensor:
        """A prompt's product: (m, k) float CPU x -> (m, n) bfloat16, the weight dequantized to
        bfloat16 by the kernels (``threads`` parts), ``chunk_values`` of it at a time into one
        buffer, each slice of rows one GEMM (torch's, on its own threads)."""
        if not x.is_floating_point() or x.dim() != 2 or x.size(1) != self.k or not x.is_cpu:
            what = f"{x.dtype} {tuple(x.shape)}"
            raise LmcliError(
                f"{self.format.name} product: inputs must be float CPU (m, {self.k}), not {what}"
            )
        _check_threads(threads)
        xb = x.to(torch.bfloat16)
        slices = -(-self.n * self.k // max(chunk_values, self.k))
        rows = -(-self.n // slices)  # weight rows a slice, the slices of even size
        buf = self.lib.gemm_buffer(rows, self.k)  # (rows, k)
        if torch.is_grad_enabled() and x.requires_grad:  # autograd keeps the weight for the backward
            buf = torch.empty(rows, self.k, dtype=torch.bfloat16)  # so it gets a buffer of its own
        y = None if rows == self.n else torch.empty(x.size(0), self.n, dtype=torch.bfloat16)  # (m, n)
        for j in range(0, self.n, rows):
            r = min(rows, self.n - j)
            self._dequantize(j, r, buf, threads)
            if y is None:
                return F.linear(xb, buf)  # (m, n): the whole weight in one slice
            y[:, j : j + r] = F.linear(xb, buf[:r])
        assert y is not None
        return y
