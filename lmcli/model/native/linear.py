"""A linear layer whose weight is GGUF blocks (q8_0, q4_0, q4_K, q5_K, q6_K) multiplied by the
native kernels, and the q8_0/q4_0 quantizers that make such blocks from a float weight.

``BlockLinear`` holds the blocks as one uint8 tensor, (out, row bytes): its memory is the bytes of
the file it came from, and ``export --format gguf`` can write them as they are. One row of
activations (decode) and many (a prompt) go through the same kernel. Where the kernels are not
available the weight is dequantized once, on first use, and multiplied by torch.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmcli.errors import LmcliError
from lmcli.model.native import ops

CHUNK_ROWS = 1024  # rows quantized at a time: the float32 temporaries stay small for a large table
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
    for i in range(0, w.size(0), CHUNK_ROWS):
        out[i : i + CHUNK_ROWS] = _quantize_rows(w[i : i + CHUNK_ROWS], fmt)
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


class BlockLinear(nn.Module):
    """``y = x @ W.T + bias`` with W (out, in) stored as GGUF blocks of ``fmt``.

    ``blocks`` (out, row bytes) uint8 is a buffer (in the state dict, as stored). The product
    runs on ``torch.get_num_threads()`` threads (lmcli's ``--threads``)."""

    def __init__(self, blocks: Tensor, fmt: str, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        self.format = ops.check_blocks(blocks, fmt, in_features)
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.size(0)
        self.register_buffer("blocks", blocks)
        self._checked = blocks  # the tensor check_blocks passed (a new one is checked before use)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._dequantized: Tensor | None = None  # the fallback's float weight, made on first use

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> BlockLinear:
        """A quantized copy of ``linear`` (its weight rounded to ``fmt`` blocks)."""
        return cls(quantize_blocks(linear.weight, fmt), fmt, linear.in_features, linear.bias)

    def weight_rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` of W as float32 (ids.shape + (in,)): a tied model's token embedding."""
        rows = self.blocks[ids.reshape(-1)]  # (len(ids), row bytes)
        return dequantize_blocks(rows, self.fmt, self.in_features).reshape(*ids.shape, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        if ops.available():
            if self.blocks is not self._checked:  # replaced since: checked before a kernel reads it
                self.format, self._checked = (
                    ops.check_blocks(self.blocks, self.fmt, self.in_features),
                    self.blocks,
                )
            y = ops.product(x, self.blocks, self.format, self.in_features, torch.get_num_threads())
            y = y.to(x.dtype)
        else:
            if self._dequantized is None:
                self._dequantized = dequantize_blocks(self.blocks, self.fmt, self.in_features)
            y = F.linear(x, self._dequantized.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class StackedBlockLinear(nn.Module):
    """A linear layer whose output rows come in parts of different block formats (a GGUF file's
    q, k and v as one fused projection, v often in another format): the parts' products side
    by side, then the bias."""

    def __init__(self, parts: list[BlockLinear], bias: Tensor | None = None) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or any(p.bias is not None for p in parts):
            raise LmcliError("stacked block layers need parts of one width and no bias of their own")
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.cat([p(x) for p in self.parts], -1)  # (..., out)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class BlockEmbedding(nn.Module):
    """A token embedding looked up in a BlockLinear's rows (a tied model's head, or an untied
    table kept as stored): each row dequantized as it is looked up, in ``dtype``."""

    def __init__(self, table: BlockLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, idx: Tensor) -> Tensor:
        return self.table.weight_rows(idx).to(self.dtype)  # (..., C)
