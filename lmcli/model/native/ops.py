"""The kernels from Python: load the library (building it on first use), check every size, call.

``matmul(x, blocks, fmt, k)`` is ``x @ W.T`` for W stored as GGUF blocks of format ``fmt``: the
rows of ``x`` are quantized to int8 per block (32 values for q8_0, q4_0, q4_1, q5_0, q5_1; 256
for the K-quants),
multiplied with integer dot products and scaled back to float32. Nothing reaches the kernel
before its shapes, dtypes, contiguity and byte counts are checked here: the C++ side trusts them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model.native import build

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


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 2, 32, 18),
        BlockFormat("q4_1", 3, 32, 20),
        BlockFormat("q5_0", 6, 32, 22),
        BlockFormat("q5_1", 7, 32, 24),
        BlockFormat("q8_0", 8, 32, 34),
        BlockFormat("q4_K", 12, 256, 144),
        BlockFormat("q5_K", 13, 256, 176),
        BlockFormat("q6_K", 14, 256, 210),
    )
}
# the library's instruction-set numbers, best last; "neon_dotprod" exists only on aarch64
ISAS = ("scalar", "avx2", "avx_vnni", "avx512_vnni", "neon_dotprod")
PREFERENCE = ("avx512_vnni", "avx_vnni", "neon_dotprod", "avx2", "scalar")


@dataclass
class Library:
    """The loaded library, where it is and the instruction sets this CPU runs."""

    lib: ctypes.CDLL
    path: Path
    isas: tuple[str, ...]

    @property
    def best(self) -> str:
        return next(i for i in PREFERENCE if i in self.isas)

    @functools.cached_property
    def best_index(self) -> int:
        return ISAS.index(self.best)

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


def _open(path: Path) -> Library:
    lib = ctypes.CDLL(str(path))
    lib.lmcli_native_supported.argtypes = [ctypes.c_int]
    lib.lmcli_native_supported.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lmcli_native_matmul.argtypes = [
        ctypes.c_int,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.lmcli_native_matmul.restype = ctypes.c_int
    lib.lmcli_native_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.lmcli_native_dequantize.restype = ctypes.c_int
    lib.lmcli_native_pool_threads.argtypes = [ctypes.c_int]
    lib.lmcli_native_pool_threads.restype = ctypes.c_int
    isas = tuple(name for n, name in enumerate(ISAS) if lib.lmcli_native_supported(n))
    return Library(lib, path, isas)


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


def check_blocks(blocks: Tensor, fmt: str, k: int) -> BlockFormat:
    """The format of ``blocks`` after checking it holds whole rows of ``k`` values in ``fmt``."""
    if fmt not in FORMATS:
        raise LmcliError(f"block format {fmt!r} has no native kernel (have: {', '.join(FORMATS)})")
    f = FORMATS[fmt]
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


def matmul(x: Tensor, blocks: Tensor, fmt: str, k: int, threads: int = 1, isa: str | None = None) -> Tensor:
    """``x (..., k) @ W.T -> (..., n)`` float32, W the (n, k) weight stored as ``blocks``
    (n, row bytes) in GGUF format ``fmt``; ``threads`` share W's rows, ``isa`` forces an
    instruction set (default: the best this CPU has). Raises LmcliError on any bad size."""
    return product(x, blocks, check_blocks(blocks, fmt, k), k, threads, isa)


def product(
    x: Tensor, blocks: Tensor, f: BlockFormat, k: int, threads: int = 1, isa: str | None = None
) -> Tensor:
    """``matmul`` for ``blocks`` that ``check_blocks`` passed (``f`` its answer): the inputs are
    checked here. A layer checks its blocks once and calls this a step."""
    lib = library()
    if lib is None:
        raise LmcliError(f"native kernels are not available: {_load()[1]}")
    if not x.is_floating_point() or x.device.type != "cpu" or x.dim() < 1 or x.size(-1) != k:
        raise LmcliError(
            f"{f.name} product: inputs must be float CPU (..., {k}), not {x.dtype} {tuple(x.shape)}"
        )
    _check_threads(threads)
    isa_index = _isa_index(lib, isa)
    n = blocks.size(0)
    x2 = x.reshape(-1, k)  # (m, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.size(0), n, dtype=torch.float32)  # (m, n)
    m, fn = x2.size(0), lib.lib.lmcli_native_matmul
    rc = fn(f.ggml_type, blocks.data_ptr(), n, k, x2.data_ptr(), m, y.data_ptr(), threads, isa_index)
    if rc != 0:
        raise LmcliError(f"native {f.name} product refused its sizes (n={n}, k={k}, rows={x2.size(0)})")
    return y.reshape(*x.shape[:-1], n)


def _isa_index(lib: Library, isa: str | None) -> int:
    if isa is None:
        return lib.best_index
    if isa in lib.isas:
        return ISAS.index(isa)
    raise LmcliError(f"instruction set {isa!r} is not available (this CPU: {', '.join(lib.isas)})")


def _check_threads(threads: int) -> None:
    if type(threads) is not int or threads < 1:
        raise LmcliError(f"threads must be a positive integer, not {threads!r}")


def dequantize(blocks: Tensor, fmt: str, k: int, threads: int = 1, isa: str | None = None) -> Tensor:
    """(n, row bytes) blocks in ``fmt`` -> the (n, k) weight in bfloat16, by the kernels: bit for
    bit ``native.blocks.dequantize_blocks(...).bfloat16()`` (a NaN may differ in its bits). Raises
    LmcliError on any bad size."""
    f = check_blocks(blocks, fmt, k)
    lib = library()
    if lib is None:
        raise LmcliError(f"native kernels are not available: {_load()[1]}")
    _check_threads(threads)
    isa_index = _isa_index(lib, isa)
    out = torch.empty(blocks.size(0), k, dtype=torch.bfloat16)  # (n, k)
    rc = lib.lib.lmcli_native_dequantize(
        f.ggml_type, blocks.data_ptr(), blocks.size(0), k, out.data_ptr(), threads, isa_index
    )
    if rc != 0:
        raise LmcliError(f"native {f.name} dequantize refused its sizes (n={blocks.size(0)}, k={k})")
    return out


class BoundProduct:
    """``product`` for one checked blocks tensor, what it can compute once computed once: a
    decode step calls ~7 products a layer, each a few microseconds of Python otherwise."""

    def __init__(self, blocks: Tensor, f: BlockFormat, k: int) -> None:
        lib = library()
        if lib is None:
            raise LmcliError(f"native kernels are not available: {_load()[1]}")
        self.blocks, self.f, self.k, self.n = blocks, f, k, blocks.size(0)  # (blocks kept alive)
        self.lib, self.fn, self.isa = lib, lib.lib.lmcli_native_matmul, lib.best_index
        self.dequant = lib.lib.lmcli_native_dequantize
        self.ptr = blocks.data_ptr()

    def __call__(self, x: Tensor, threads: int) -> Tensor:
        """(m, k) float32 contiguous CPU x -> (m, n); any other x goes through ``product``'s checks."""
        if (
            x.dtype is not torch.float32
            or x.dim() != 2
            or x.size(1) != self.k
            or not x.is_cpu
            or not x.is_contiguous()
        ):
            return product(x, self.blocks, self.f, self.k, threads)
        y = torch.empty(x.size(0), self.n)  # (m, n) float32
        rc = self.fn(
            self.f.ggml_type,
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
            raise LmcliError(f"native {self.f.name} product refused its sizes (n={self.n}, k={self.k})")
        return y

    def gemm(self, x: Tensor, threads: int, chunk_values: int = GEMM_CHUNK_VALUES) -> Tensor:
        """A prompt's product: (m, k) float CPU x -> (m, n) bfloat16, the weight dequantized to
        bfloat16 by the kernels (``threads`` parts), ``chunk_values`` of it at a time into one
        buffer, each slice of rows one GEMM (torch's, on its own threads)."""
        if not x.is_floating_point() or x.dim() != 2 or x.size(1) != self.k or not x.is_cpu:
            what = f"{x.dtype} {tuple(x.shape)}"
            raise LmcliError(f"{self.f.name} product: inputs must be float CPU (m, {self.k}), not {what}")
        _check_threads(threads)
        xb = x.to(torch.bfloat16)
        slices = -(-self.n * self.k // max(chunk_values, self.k))
        rows = -(-self.n // slices)  # weight rows a slice, the slices of even size
        buf = self.lib.gemm_buffer(rows, self.k)  # (rows, k)
        if torch.is_grad_enabled() and x.requires_grad:  # autograd keeps the weight for the backward
            buf = torch.empty(rows, self.k, dtype=torch.bfloat16)  # so it gets a buffer of its own
        row_bytes = self.f.row_bytes(self.k)
        y = None if rows == self.n else torch.empty(x.size(0), self.n, dtype=torch.bfloat16)  # (m, n)
        for j in range(0, self.n, rows):
            r = min(rows, self.n - j)
            w = self.ptr + j * row_bytes
            if self.dequant(self.f.ggml_type, w, r, self.k, buf.data_ptr(), threads, self.isa) != 0:
                raise LmcliError(f"native {self.f.name} dequantize refused its sizes (n={r}, k={self.k})")
            if y is None:
                return F.linear(xb, buf)  # (m, n): the whole weight in one slice
            y[:, j : j + r] = F.linear(xb, buf[:r])
        assert y is not None
        return y
