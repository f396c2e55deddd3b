"""GGUF blocks from and to float weights: ``quantize_blocks`` writes every format of ``WRITES``
(the 32-value formats, the K-quants, iq4_nl, iq4_xs) byte for byte as ggml's quantizer does
(``ggml_quantize_chunk``, what llama-quantize calls), with or without importance weights, so
``--quantize``, an exported GGUF file and llama.cpp's own file are one thing;
``dequantize_blocks`` reads every native format back (the fallback, the lookups of a block
embedding). The layer that holds blocks is ``lmcli.model.quant.BlockLinear``.

The quantizer is the native library's (``quantize.cpp``); without it, q8_0 and q4_0 (without
importance weights) are written by torch code here, byte for byte the same, and any other format
is refused in one line (``lmcli.model.small_blocks``, whose bytes the quantized KV cache
holds too).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model.native import ops
from lmcli.model.small_blocks import dequantize_rows, quantize_rows

# values quantized at a time (whole rows, one at least): the float32 temporaries (a few copies
# of the chunk) stay a few MB for any shape; 1024 rows of an MLP's 4864-wide down projection
# took 108 MB at once (Qwen2.5-0.5B shape, --quantize int8)
CHUNK_VALUES = 1 << 20
# the library's calls: a few large ones (its threads split each), float32 copies of a chunk at most
NATIVE_CHUNK_VALUES = 1 << 24
SOURCE_TYPES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 30,
}  # rows the library reads (GGML's numbers)
QUANTIZABLE = ("q8_0", "q4_0")  # formats torch's code writes (without the library)
# formats quantize_blocks writes with the native library (GGML's names)
WRITES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")


def block_shape(fmt: str) -> tuple[int, int]:
    """(values, bytes) of one block of ``fmt`` (GGML's name), as the ``gguf`` package states them."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt.upper()]]


def quantize_blocks(w: Tensor, fmt: str, imatrix: Tensor | None = None, threads: int | None = None) -> Tensor:
    """(n, k) float weight -> (n, row bytes) uint8 blocks in ``fmt`` (one of ``WRITES``), byte for
    byte what ggml's quantizer writes; ``imatrix``: (k,) importance weights, one an input column
    (llama-quantize's per-tensor ``quant_weights``; q8_0 ignores them, as ggml does);
    ``threads``: the library's threads (default torch's)."""
    if fmt not in WRITES:
        raise LmcliError(f"lmcli quantizes to {', '.join(WRITES)}, not {fmt!r}")
    block, block_bytes = block_shape(fmt)
    if w.dim() != 2 or w.size(1) % block:
        raise LmcliError(f"a {fmt} weight needs rows of a multiple of {block} values, not {tuple(w.shape)}")
    if imatrix is not None and tuple(imatrix.shape) != (w.size(1),):
        raise LmcliError(f"{fmt}: {tuple(imatrix.shape)} importance weights for rows of {w.size(1)} values")
    w = w.detach().cpu()
    out = torch.empty(w.size(0), w.size(1) // block * block_bytes, dtype=torch.uint8)
    lib = ops.library()
    if lib is None:
        check_writable([fmt], imatrix is not None)
        rows = max(1, CHUNK_VALUES // w.size(1))
        for i in range(0, w.size(0), rows):
            out[i : i + rows] = quantize_rows(w[i : i + rows], fmt)
        return out
    _native_quantize(lib.lib, w, fmt, imatrix, out, threads or torch.get_num_threads())
    return out


def check_writable(formats: list[str], weighted: bool = False) -> None:
    """One line unless every one of ``formats`` can be written here (``weighted``: with
    importance weights): the native library writes them all, torch's code q8_0 and q4_0."""
    if ops.library() is not None:
        return
    need = [f for f in sorted(set(formats)) if f not in QUANTIZABLE or (weighted and f != "q8_0")]
    if need:
        why = ops.backend_line().removeprefix("quantized products: torch ")
        raise LmcliError(
            f"writing {', '.join(need)} blocks needs lmcli's native library, which is not available {why}"
        )


@functools.cache
def _quantizer(lib: ctypes.CDLL) -> Any:
    """The library's ``lmcli_native_quantize`` with its argument types set."""
    fn = lib.lmcli_native_quantize
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ptr, ctypes.c_int, i64, i64, ptr, ptr, ctypes.c_int]
    fn.restype = i64
    return fn


def _native_quantize(
    lib: ctypes.CDLL, w: Tensor, fmt: str, imatrix: Tensor | None, out: Tensor, threads: int
) -> None:
    """The library's quantizer over ``w``, a chunk of rows at a time: float32, float16 and bfloat16
    rows as they are (the library widens each row as it takes it), others as float32 copies."""
    qw = None if imatrix is None else imatrix.detach().cpu().to(torch.float32).contiguous()
    qtype = int(gguf.GGMLQuantizationType[fmt.upper()])
    rows = max(1, NATIVE_CHUNK_VALUES // w.size(1))
    for i in range(0, w.size(0), rows):
        chunk = w[i : i + rows]  # (r, k)
        if chunk.dtype not in SOURCE_TYPES:
            chunk = chunk.to(torch.float32)
        chunk = chunk.contiguous()
        dst = out[i : i + rows]
        qw_ptr = qw.data_ptr() if qw is not None else None
        x_type = SOURCE_TYPES[chunk.dtype]
        done = _quantizer(lib)(qtype, chunk.data_ptr(), x_type, *chunk.shape, qw_ptr, dst.data_ptr(), threads)
        if done != dst.numel():  # the sizes were checked here: a library that disagrees is a bug
            raise RuntimeError(f"the native quantizer wrote {done} bytes of {fmt}, not {dst.numel()}")


def dequantize_blocks(blocks: Tensor, fmt: str, k: int) -> Tensor:
    """(n, row bytes) blocks -> (n, k) float32 weight (torch for q8_0/q4_0, gguf's numpy otherwise)."""
    ops.check_blocks(blocks, fmt, k)
    n = blocks.size(0)
    if fmt in QUANTIZABLE:
        return dequantize_rows(blocks, fmt, k)
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)
