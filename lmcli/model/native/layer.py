"""One decoding step of a whole Transformer block in one native call (``layer.inc``).

A ``NativeLayer`` holds one block's weights, checked once when it is made: the products' GGUF
blocks (``ops.check_blocks``), the norms' float32 weights and every size against every other.
``StepArgs.checked`` checks, once a decoding step for every layer, what changes from step to step
(the rows' count, the cache's buffers, the new column, the rows' left padding, their rotary rows);
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
    """A product's weight as GGUF blocks (out, row bytes) in ``fmt`` over ``k`` inputs, and its
    float32 bias (out,) or None."""

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
        if sum(p.blocks.size(0) for p in w.qkv) != (H + 2 * KV) * D:
            raise LmcliError(f"native layer: the query/key/value products give {(H + 2 * KV) * D} outputs")
        self.weights = w  # (keeps every buffer the structure points at alive)
        self.fn, self.isa, self.lib = lib.lib.lmcli_native_layer_step, lib.best_index, lib
        self.width, self.kv_heads, self.head_dim = C, KV, D
        post = w.post or (None, None)
        qk = w.qk_norm or (None, None)
        s = LmLayer(C, H, KV, D, F, acts.index(w.act), len(w.qkv), w.eps, w.qk_eps, w.scale)
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
        int64 of each row's cos and sin; ``cache``: (keys, values, the library's dtype number,
        columns)."""
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


def _cache(layer: NativeLayer, rows: int, k: Tensor, v: Tensor) -> int:
    """The library's number for the cache's dtype, after checking that k and v are (layers, rows,
    kv heads, columns, head size) contiguous CPU buffers of one dtype."""
    names = layer.lib.report.cache_types
    shape = (k.size(0) if k.dim() == 5 else -1, rows, layer.kv_heads, k.size(3) if k.dim() == 5 else -1)
    shape += (layer.head_dim,)
    name = str(k.dtype).removeprefix("torch.")
    if k.shape != shape or v.shape != shape or k.dtype != v.dtype or name not in names:
        raise LmcliError(f"native layer: a cache of {k.dtype} {tuple(k.shape)} does not fit {shape}")
    if not (k.is_contiguous() and v.is_contiguous() and k.is_cpu and v.is_cpu):
        raise LmcliError("native layer: the cache must be contiguous CPU buffers")
    return names.index(name)


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
    the rows, their left padding, the cache's buffers and new column, the rows' rotary turns
    (global and sliding-window layers')."""

    rows: int
    width: int
    start: Tensor | None  # (B,) int64: each row's first column (left padding), or None
    k: int
    v: int
    layers: int
    layer_bytes: int  # from one layer's keys to the next's
    cache_type: int
    columns: int
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
    ) -> StepArgs:
        """The arguments of a step of ``rows`` rows through layers like ``layer``: the new key
        and value go to ``column`` of the cache k, v (layers, B, KV, columns, D), row b attends to
        columns start[b]..column (``start`` (B,) int64; None: no padding), and turns by its
        ``rotary`` rows (a global and a sliding-window layer's; None: no rotary). Raises
        LmcliError for anything the library could not take."""
        cache_type = _cache(layer, rows, k, v)
        if type(column) is not int or not 0 <= column < k.size(3):
            raise LmcliError(f"native layer: column {column} is outside the cache's {k.size(3)}")
        if start is not None:
            if (
                start.dtype != torch.int64
                or start.shape != (rows,)
                or not (start.is_contiguous() and start.is_cpu)
            ):
                raise LmcliError(
                    f"native layer: start must be int64 ({rows},), not {start.dtype} {tuple(start.shape)}"
                )
            if not 0 <= int(start.min()) <= int(start.max()) <= column:
                raise LmcliError(f"native layer: a row starts outside columns 0..{column}")
        if type(threads) is not int or threads < 1:
            raise LmcliError(f"native layer: threads must be a positive integer, not {threads!r}")
        turns = (_turns(layer, rows, rotary[0]), _turns(layer, rows, rotary[1]))
        layer_bytes = k.stride(0) * k.element_size()
        return cls(
            rows,
            layer.width,
            start,
            k.data_ptr(),
            v.data_ptr(),
            k.size(0),
            layer_bytes,
            cache_type,
            k.size(3),
            column,
            turns,
            threads,
            (k, v, rotary),
        )

    def run(self, layer: NativeLayer, x: Tensor, row: int, local: int, rotary: bool) -> Tensor:
        """x (B, C) through ``layer``, whose keys and values are the cache's row ``row`` (its
        ``local`` turns, or none where ``rotary`` is False): x itself, changed in place, where
        it is float32 and contiguous, else its float32 copy."""
        if x.shape != (self.rows, self.width) or layer.width != self.width or not 0 <= row < self.layers:
            raise LmcliError(
                f"native layer: rows {tuple(x.shape)} of layer {row} do not fit ({self.rows}, {self.width})"
            )
        if not x.is_contiguous() or x.dtype != torch.float32 or not x.is_cpu:
            x = x.to("cpu", torch.float32).contiguous()
        at = row * self.layer_bytes
        layer.call(
            x.data_ptr(),
            self.rows,
            self.turns[local] if rotary else None,
            None if self.start is None else self.start.data_ptr(),
            (self.k + at, self.v + at, self.cache_type, self.columns),
            self.column,
            self.threads,
        )
        return x
