"""GGUF blocks from and to float weights: ``quantize_blocks`` writes q8_0/q4_0 blocks byte for
byte as ggml's reference quantizer does (so ``--quantize int8|int4`` and a GGUF file's blocks are
one thing), ``dequantize_blocks`` reads every native format back (the fallback, the lookups of a
block embedding). The layer that holds blocks is ``lmcli.model.quant.BlockLinear``.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model.native import ops

# values quantized at a time (whole rows, one at least): the float32 temporaries (a few copies
# of the chunk) stay a few MB for any shape; 1024 rows of an MLP's 4864-wide down projection
# took 108 MB at once (Qwen2.5-0.5B shape, --quantize int8)
CHUNK_VALUES = 1 << 20
QUANTIZABLE = ("q8_0", "q4_0")  # formats quantize_blocks writes; all of ops.FORMATS are read


def _fp16_bytes(d: Tensor) -> Tensor:
    """(b, 1) float32 -> (b, 2) uint8: the scales as IEEE halves, little-endian as GGUF stores them."""
    return d.to(torch.float16).view(torch.int16).view(torch.uint8).reshape(-1, 2)


def _round_half_away(v: Tensor) -> Tensor:
    """ggml's roundf, written as gguf's quantizer writes it (so the bytes are the same)."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _quantize_rows(w: Tensor, fmt: str) -> Tensor:
    blocks = w.to(torch.float32).reshape(-1, 32)  # (b, 32)
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
    return torch.cat([_fp16_bytes(d), q], 1).reshape(w.size(0), -1)  # (rows, row bytes)


def quantize_blocks(w: Tensor, fmt: str) -> Tensor:
    """(n, k) float weight -> (n, row bytes) uint8 blocks in ``fmt`` ("q8_0" or "q4_0"), byte for
    byte what ggml's (and the gguf package's) reference quantizer writes."""
    if fmt not in QUANTIZABLE:
        raise LmcliError(f"lmcli quantizes to {' or '.join(QUANTIZABLE)}, not {fmt!r}")
    if w.dim() != 2 or w.size(1) % 32:
        raise LmcliError(f"a {fmt} weight needs rows of a multiple of 32 values, not {tuple(w.shape)}")
    w = w.detach().cpu()
    out = torch.empty(w.size(0), ops.FORMATS[fmt].row_bytes(w.size(1)), dtype=torch.uint8)
    rows = max(1, CHUNK_VALUES // w.size(1))
    for i in range(0, w.size(0), rows):
        out[i : i + rows] = _quantize_rows(w[i : i + rows], fmt)
    return out


def dequantize_blocks(blocks: Tensor, fmt: str, k: int) -> Tensor:
    """(n, row bytes) blocks -> (n, k) float32 weight (torch for q8_0/q4_0, gguf's numpy otherwise)."""
    f = ops.check_blocks(blocks, fmt, k)
    n = blocks.size(0)
    b = blocks.reshape(-1, f.block_bytes)  # (n * blocks a row, block bytes)
    if fmt in QUANTIZABLE:
        d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)  # (b, 1)
        if fmt == "q8_0":
            q = b[:, 2:].view(torch.int8).to(torch.float32)
        else:
            nib = b[:, 2:]
            q = torch.cat([nib & 0x0F, nib >> 4], 1).to(torch.float32) - 8
        return (q * d).reshape(n, k)
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)
