"""One decoding step of a whole Transformer block in one native call (``layer.inc``).

A ``NativeLayer`` holds one block's weights, checked once when it is made: the products' GGUF
blocks or float weights (``ops.check_blocks``), the norms' float32 weights and every size against
every other. ``StepArgs.checked`` checks, once a decoding step for every layer, what changes from
step to step (the rows' count, the cache's buffers, a sliding window's ring of them, the new
column, the rows' left padding, their rotary rows);
``StepArgs.run`` then calls the library for one layer (its rows checked against the layer), which
trusts all of it. The model-side glue, which decides which blocks and steps qualify and reads
their weights, is ``lmcli.model.fastpath.native_step``. The structures are ``abi.py``'s mirrors of
``abi.h``; the nonlinearities' and cache types' numbers are the library's (``abi.Report``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model.native import ops
from lmcli.model.native.abi import LmLayer, LmLinear


@dataclass(frozen=True)
class Product:
    """A product's weight as GGUF blocks (out, row bytes) in ``fmt`` over ``k`` inputs (a float
    weight's bytes in "f32", "f16" or "bf16": ``ops.float_blocks``), and its float32 bias (out,)
    or None."""

    blocks: Tensor
    fmt: str
    k: int
    bias: Tensor | None = None


@dataclass(frozen=True)
class LayerWeights:
    """A pre-norm (or sandwich) block with rotary attention and a gated MLP, as the step reads it."""

    heads: int
    kv_heads: int
    head_dim: int
    act: str  # one of the library's nonlinearities (abi.h's LM_ACT_LIST: silu, gelu_tanh)
    eps: float
    scale: float  # of the attention scores
    norm_1: Tensor  # (C,) float32: the norms' multipliers (1 + w for Gemma's form)
    norm_2: Tensor
    qkv: tuple[Product, ...]  # 1-3 parts, outputs side by side: queries, keys, values
    out: Product
    gate: Product
    up: Product
    down: Product
    post: tuple[Tensor, Tensor] | None = None  # sandwich norms of the sublayers' outputs
    qk_norm: tuple[Tensor, Tensor] | None = None  # (D,) multipliers of the per-head q and k norms
    qk_eps: float = 0.0
    window: int = 0  # a sliding window's columns (a query sees the last ``window``), 0: all
    softcap: float = 0.0  # the scores capped softly, softcap tanh(s / softcap); 0: not capped


def _vector(t: Tensor, n: int, what: str) -> int:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 1 or t.numel() != n:
        raise LmcliError(f"native layer: {what} must be float32 ({n},), not {t.dtype} {tuple(t.shape)}")
    if not t.is_contiguous():
        raise LmcliError(f"native layer: {what} must be contiguous")
    return t.data_ptr()


def _linear(p: Product, n: int | None, k: int, what: str) -> LmLinear:
    f = ops.check_blocks(p.blocks, p.fmt, p.k)
    if p.k != k or (n is not None and p.blocks.size(0) != n):
        raise LmcliError(f"native layer: {what} is ({p.blocks.size(0)}, {p.k}), the block needs ({n}, {k})")
    bias = None if p.bias is None else _vector(p.bias, p.blocks.size(0), f"{what}'s bias")
    return LmLinear(f.ggml_type, p.blocks.data_ptr(), p.blocks.size(0), k, bias)


class NativeLayer:
    """A block's decoding step in one call (``StepArgs.run``): x (B, C) becomes the block's output
    in place and the new key and value go into the cache."""

    def __init__(self, w: LayerWeights) -> None:
        lib = ops.library()
        if lib is None:
            raise LmcliError("native kernels are not available")
        H, KV, D = w.heads, w.kv_heads, w.head_dim
        C, F = w.out.blocks.size(0), w.up.blocks.size(0)
        acts = lib.report.acts
        if KV < 1 or H % KV or D % 2 or w.act not in acts or not 1 <= len(w.qkv) <= 3:
            raise LmcliError(f"native layer: {H} heads over {KV} KV heads of {D}, {w.act!r}: unsupported")
        if w.window < 0 or not w.softcap >= 0:
            raise LmcliError(f"native layer: window {w.window}, soft cap {w.softcap}: unsupported")
        if sum(p.blocks.size(0) for p in w.qkv) != (H + 2 * KV) * D:
            raise LmcliError(f"native layer: the query/key/value products give {(H + 2 * KV) * D} outputs")
        self.weights = w  # (keeps every buffer the structure points at alive)
        self.fn, self.isa, self.lib = lib.lib.lmcli_native_layer_step, lib.best_index, lib
        self.width, self.kv_heads, self.head_dim, self.window = C, KV, D, w.window
        post = w.post or (None, None)
        qk = w.qk_norm or (None, None)
        s = LmLayer(C, H, KV, D, F, acts.index(w.act), len(w.qkv), w.window)
        s.eps, s.qk_eps, s.scale, s.softcap = w.eps, w.qk_eps, w.scale, w.softcap
        s.norm1, s.norm2 = _vector(w.norm_1, C, "norm 1"), _vector(w.norm_2, C, "norm 2")
        s.post1 = None if post[0] is None else _vector(post[0], C, "post norm 1")
        s.post2 = None if post[1] is None else _vector(post[1], C, "post norm 2")
        s.q_norm = None if qk[0] is None else _vector(qk[0], D, "query norm")
        s.k_norm = None if qk[1] is None else _vector(qk[1], D, "key norm")
        for i, part in enumerate(w.qkv):
            s.qkv[i] = _linear(part, None, C, f"query/key/value part {i}")
        s.o = _linear(w.out, C, H * D, "the attention's output")
        s.gate = _linear(w.gate, F, C, "the MLP's gate")
        s.up = _linear(w.up, F, C, "the MLP's up projection")
        s.down = _linear(w.down, C, F, "the MLP's down projection")
        self.struct, self.ref = s, ctypes.byref(s)

    def call(
        self,
        x: int,
        rows: int,
        turns: tuple[Tensor, Tensor] | None,
        start: int | None,
        cache: tuple[int, int, int, int],
        column: int,
        threads: int,
    ) -> None:
        """The library's call for addresses ``StepArgs`` checked: ``turns``, the addresses (B,)
        int64 of each row's cos and sin; ``cache``: (keys, values, the library's cache type,
        columns); ``column``: the new token's column in the sequence (in the cache's row
        column % columns)."""
        cos, sin = (None, None) if turns is None else (turns[0].data_ptr(), turns[1].data_ptr())
        k, v, dtype, columns = cache
        if self.fn(self.ref, x, rows, cos, sin, start, k, v, dtype, columns, column, threads, self.isa) != 0:
            raise LmcliError(f"native layer step refused its sizes (rows={rows}, column={column})")


@dataclass(frozen=True)
class RotaryRows:
    """A rotary table cos, sin (N, D/2) float32 (an angle a pair of dimensions) and each row's
    position in it (B,) int64: the turns of the rows' new tokens."""

    cos: Tensor
    sin: Tensor
    positions: Tensor


@dataclass(frozen=True)
class Buffers:
    """One pair of the cache's buffers, keys and values (layers, B, KV, columns, row), by address:
    the plain cache's, or a sliding window's ring (column c of the sequence in column c % columns)."""

    k: int
    v: int
    layers: int
    layer_bytes: int  # from one layer's keys to the next's
    columns: int


def cache_row(fmt: str, head_dim: int) -> tuple[int, torch.dtype]:
    """The length and dtype of a cached head row in ``fmt`` (a float dtype's name: D values of it;
    "q8_0" or "q4_0": D / 32 blocks of that many bytes, uint8)."""
    if fmt in CACHE_BLOCKS:
        return head_dim // 32 * CACHE_BLOCKS[fmt], torch.uint8
    return head_dim, getattr(torch, fmt)


CACHE_BLOCKS = {"q8_0": 34, "q4_0": 18}  # bytes of a 32-value block of a quantized cache


def _buffers(layer: NativeLayer, rows: int, k: Tensor, v: Tensor, fmt: str) -> Buffers:
    """``Buffers`` of k and v after checking that they are (layers, rows, kv heads, columns, row)
    contiguous CPU buffers of ``fmt``'s rows (``cache_row``)."""
    width, dtype = cache_row(fmt, layer.head_dim)
    layers, columns = (k.size(0), k.size(3)) if k.dim() == 5 else (-1, -1)
    shape = (layers, rows, layer.kv_heads, columns, width)
    if k.shape != shape or v.shape != shape or k.dtype != dtype or v.dtype != dtype:
        raise LmcliError(f"native layer: a cache of {k.dtype} {tuple(k.shape)} does not fit {shape} {fmt}")
    if not (k.is_contiguous() and v.is_contiguous() and k.is_cpu and v.is_cpu):
        raise LmcliError("native layer: the cache must be contiguous CPU buffers")
    return Buffers(k.data_ptr(), v.data_ptr(), layers, k.stride(0) * k.element_size(), columns)


def _turns(layer: NativeLayer, rows: int, rotary: RotaryRows | None) -> tuple[Tensor, Tensor] | None:
    """The addresses (B,) int64 of each row's cos and sin rows, after checking the table."""
    if rotary is None:
        return None
    half = layer.head_dim // 2
    cos, sin, at = rotary.cos, rotary.sin, rotary.positions
    fits = [
        t.dim() == 2 and t.shape[1:] == (half,) and t.dtype == torch.float32 and t.is_contiguous()
        for t in (cos, sin)
    ]
    if not all(fits) or cos.shape != sin.shape or not (cos.is_cpu and sin.is_cpu):
        raise LmcliError(f"native layer: the rotary table must be float32 rows (N, {half})")
    if (
        at.dtype != torch.int64
        or at.shape != (rows,)
        or not 0 <= int(at.min()) <= int(at.max()) < cos.size(0)
    ):
        raise LmcliError(
            f"native layer: the rows' positions must be int64 ({rows},) within the table's {cos.size(0)}"
        )
    offsets = at * (half * 4)
    return offsets + cos.data_ptr(), offsets + sin.data_ptr()


@dataclass(frozen=True)
class StepArgs:
    """What one decoding step's native calls share, checked once for every layer (``checked``):
    the rows, their left padding, the cache's buffers (a sliding window's ring among them) and
    new column, the rows' rotary turns (global and sliding-window layers')."""

    rows: int
    width: int
    start: Tensor | None  # (B,) int64: each row's first column (left padding), or None
    buffers: tuple[Buffers, Buffers | None]  # the plain cache's, the ring's (or None)
    cache_type: int
    column: int
    turns: tuple[tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None]  # (B,) addresses of cos, sin
    threads: int
    held: tuple  # the tensors the addresses point into (kept alive as long as these arguments)

    @classmethod
    def checked(
        cls,
        layer: NativeLayer,
        rows: int,
        k: Tensor,
        v: Tensor,
        column: int,
        start: Tensor | None = None,
        rotary: tuple[RotaryRows | None, RotaryRows | None] = (None, None),
        threads: int = 1,
        ring: tuple[Tensor, Tensor] | None = None,
        fmt: str | None = None,
    ) -> StepArgs:
        """The arguments of a step of ``rows`` rows through layers like ``layer``: the new key
        and value go to ``column`` of the cache k, v (layers, B, KV, columns, row) or, for a
        layer in the sliding window's ``ring`` (its k, v of the same form), to its column
        ``column`` % its columns; row b attends to columns start[b]..column (``start`` (B,) int64;
        None: no padding; a row that starts after ``column`` sees that column alone), and turns
        by its ``rotary`` rows (a global and a sliding-window layer's; None: no rotary). ``fmt``:
        the cache's rows, "q8_0" or "q4_0" (uint8 blocks), else (None) k's float dtype. Raises
        LmcliError for anything the library could not take."""
        names = layer.lib.report.cache_types
        fmt = fmt or str(k.dtype).removeprefix("torch.")
        if fmt not in names:
            raise LmcliError(f"native layer: a cache of {fmt} does not fit ({', '.join(names)})")
        plain = _buffers(layer, rows, k, v, fmt)
        rung = None if ring is None else _buffers(layer, rows, ring[0], ring[1], fmt)
        if type(column) is not int or column < 0 or (plain.layers > 0 and column >= plain.columns):
            raise LmcliError(f"native layer: column {column} is outside the cache's {plain.columns}")
        if start is not None:
            if (
                start.dtype != torch.int64
                or start.shape != (rows,)
                or not (start.is_contiguous() and start.is_cpu)
            ):
                raise LmcliError(
                    f"native layer: start must be int64 ({rows},), not {start.dtype} {tuple(start.shape)}"
                )
            if int(start.min()) < 0:
                raise LmcliError("native layer: a row starts before column 0")
        if type(threads) is not int or threads < 1:
            raise LmcliError(f"native layer: threads must be a positive integer, not {threads!r}")
        turns = (_turns(layer, rows, rotary[0]), _turns(layer, rows, rotary[1]))
        held = (k, v, ring, rotary)
        return cls(rows, layer.width, start, (plain, rung), names.index(fmt), column, turns, threads, held)

    def run(
        self, layer: NativeLayer, x: Tensor, row: int, local: int, rotary: bool, ringed: bool = False
    ) -> Tensor:
        """x (B, C) through ``layer``, whose keys and values are row ``row`` of the cache's
        buffers (of its sliding window's ring where ``ringed``), turned by its ``local`` turns
        (none where ``rotary`` is False): x itself, changed in place, where it is float32 and
        contiguous, else its float32 copy."""
        buffers = self.buffers[1] if ringed else self.buffers[0]
        if (
            x.shape != (self.rows, self.width)
            or layer.width != self.width
            or buffers is None
            or not 0 <= row < buffers.layers
        ):
            raise LmcliError(
                f"native layer: rows {tuple(x.shape)} of layer {row} do not fit ({self.rows}, {self.width})"
            )
        if ringed and not 0 < layer.window <= buffers.columns:
            raise LmcliError(f"native layer: window {layer.window} does not fit a ring of {buffers.columns}")
        if not x.is_contiguous() or x.dtype != torch.float32 or not x.is_cpu:
            x = x.to("cpu", torch.float32).contiguous()
        at = row * buffers.layer_bytes
        layer.call(
            x.data_ptr(),
            self.rows,
            self.turns[local] if rotary else None,
            None if self.start is None else self.start.data_ptr(),
            (buffers.k + at, buffers.v + at, self.cache_type, buffers.columns),
            self.column,
            self.threads,
        )
        return x
