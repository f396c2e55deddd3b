"""GGUF blocks from and to float weights: ``quantize_blocks`` writes q8_0/q4_0 blocks byte for
byte as ggml's reference quantizer does (``lmcli.model.small_blocks``; so ``--quantize int8|int4``
and a GGUF file's blocks are one thing), ``dequantize_blocks`` reads every native format back (the
fallback, the lookups of a block embedding). The layer that holds blocks is
``lmcli.model.quant.BlockLinear``.
"""

from __future__ import annotations

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
QUANTIZABLE = ("q8_0", "q4_0")  # formats quantize_blocks writes; all of ops.FORMATS are read


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
        out[i : i + rows] = quantize_rows(w[i : i + rows], fmt)
    return out


def dequantize_blocks(blocks: Tensor, fmt: str, k: int) -> Tensor:
    """(n, row bytes) blocks -> (n, k) float32 weight (torch for q8_0/q4_0, gguf's numpy otherwise)."""
    ops.check_blocks(blocks, fmt, k)
    n = blocks.size(0)
    if fmt in QUANTIZABLE:
        return dequantize_rows(blocks, fmt, k)
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)
