"""ggml's q8_0 and q4_0 blocks of 32 values in torch, on any device: float rows to blocks, byte for
byte as ggml's reference quantizer (and the gguf package's) writes them, and blocks back to
float32 values. The native kernels' weights (``--quantize int8|int4``: ``native.blocks``) and the
quantized KV cache (``--kv-dtype q8_0|q4_0``: ``kv_cache``) are these bytes.

- q8_0: ``d = max|x| / 127`` (an IEEE half), 32 int8 ``round(x / d)`` (ties away from zero);
  value ``d q``;
- q4_0: ``d = m / -8`` for ``m`` the block's value of the largest magnitude, 16 bytes of nibbles
  ``min(15, trunc(x / d + 8.5))`` (element i in the low nibble of byte i, i + 16 in the high
  one); value ``d (q - 8)``.
"""

from __future__ import annotations

import gguf
import torch
from torch import Tensor

from lmcli.errors import LmcliError

BLOCK = 32
# bytes of a block, as the gguf package states them (the one table Python reads; formats.h is C++'s)
BLOCK_BYTES = {f: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f.upper()]][1] for f in ("q8_0", "q4_0")}


def row_bytes(fmt: str, n: int) -> int:
    """Bytes of a row of ``n`` values (a multiple of 32) in ``fmt``."""
    if fmt not in BLOCK_BYTES:
        raise LmcliError(f"unknown block format {fmt!r} (have: {', '.join(BLOCK_BYTES)})")
    if n % BLOCK:
        raise LmcliError(f"{fmt} rows need a multiple of {BLOCK} values, not {n}")
    return n // BLOCK * BLOCK_BYTES[fmt]


def _fp16_bytes(d: Tensor) -> Tensor:
    """(b, 1) float32 -> (b, 2) uint8: the scales as IEEE halves, little-endian as GGUF stores them."""
    return d.to(torch.float16).view(torch.int16).view(torch.uint8).reshape(-1, 2)


def _round_half_away(v: Tensor) -> Tensor:
    """ggml's roundf, written as gguf's quantizer writes it (so the bytes are the same)."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def quantize_rows(x: Tensor, fmt: str) -> Tensor:
    """x (..., n) float -> (..., row bytes) uint8 blocks of ``fmt`` ("q8_0" or "q4_0"), on x's device."""
    size = row_bytes(fmt, x.size(-1))
    blocks = x.detach().to(torch.float32).reshape(-1, BLOCK)  # (b, 32)
    if fmt == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = _round_half_away(blocks * inv).to(torch.int8).view(torch.uint8)  # (b, 32)
    else:  # q4_0: the value of largest magnitude is -8 d
        peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d = peak / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = torch.trunc(blocks * inv + 8.5).to(torch.uint8).clamp(0, 15)
        q = q[:, :16] | (q[:, 16:] << 4)  # (b, 16): element i in the low nibble, i + 16 in the high
    return torch.cat([_fp16_bytes(d), q], 1).reshape(*x.shape[:-1], size)  # (b, block bytes) -> rows


def dequantize_rows(b: Tensor, fmt: str, n: int) -> Tensor:
    """(..., row bytes) uint8 blocks of ``fmt`` -> (..., n) float32 values, on b's device."""
    if b.size(-1) != row_bytes(fmt, n):
        raise LmcliError(f"{fmt} rows of {n} values take {row_bytes(fmt, n)} bytes, not {b.size(-1)}")
    blocks = b.reshape(-1, BLOCK_BYTES[fmt])  # (blocks, block bytes)
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)  # (b, 1)
    if fmt == "q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        nib = blocks[:, 2:]
        q = torch.cat([nib & 0x0F, nib >> 4], 1).to(torch.float32) - 8
    return (q * d).reshape(*b.shape[:-1], n)
