"""One decoding step of a whole Transformer block in one native call (``layer.inc``).

A ``NativeLayer`` holds one block's weights, checked once when it is made: the products' GGUF
blocks (``ops.check_blocks``), the norms' float32 weights and every size against every other.
``step`` then checks what changes from step to step (the rows, the cache buffers, the column) and
calls the library, which trusts all of it. The model-side glue, which decides which blocks qualify
and reads their weights, is ``lmcli.model.fastpath.native_step``.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.model.native import ops

i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
ACTS = ("silu", "gelu_tanh")  # the gated MLP's nonlinearities, in the library's numbering
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class LmLinear(ctypes.Structure):
    _fields_ = [("wtype", i64), ("w", ptr), ("n", i64), ("k", i64), ("bias", ptr)]


class LmLayer(ctypes.Structure):
    _fields_ = [
        *((name, i64) for name in ("C", "H", "KV", "D", "F", "act", "nqkv")),
        *((name, f64) for name in ("eps", "qk_eps", "scale")),
        *((name, ptr) for name in ("norm1", "norm2", "post1", "post2", "q_norm", "k_norm")),
        ("qkv", LmLinear * 3),
        *((name, LmLinear) for name in ("o", "gate", "up", "down")),
    ]


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
    act: str  # one of ACTS
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


@functools.cache
def _function() -> ctypes._CFuncPtr:
    lib = ops.library()
    if lib is None:
        raise LmcliError("native kernels are not available")
    fn = lib.lib.lmcli_native_layer_step
    # (layer, x, rows, cos rows, sin rows, start, k, v, cache type, columns, column, threads, instruction set)
    c_int = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(LmLayer), ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, c_int, c_int]
    fn.restype = ctypes.c_int
    return fn


class NativeLayer:
    """A block's decoding step in one call: ``step(x, ...)`` turns x (B, C) into the block's
    output in place and writes the new key and value into the cache."""

    def __init__(self, w: LayerWeights) -> None:
        H, KV, D = w.heads, w.kv_heads, w.head_dim
        C, F = w.out.blocks.size(0), w.up.blocks.size(0)
        if KV < 1 or H % KV or D % 2 or w.act not in ACTS or not 1 <= len(w.qkv) <= 3:
            raise LmcliError(f"native layer: {H} heads over {KV} KV heads of {D}, {w.act!r}: unsupported")
        if sum(p.blocks.size(0) for p in w.qkv) != (H + 2 * KV) * D:
            raise LmcliError(f"native layer: the query/key/value products give {(H + 2 * KV) * D} outputs")
        self.weights = w  # (keeps every buffer the structure points at alive)
        self.fn, self.isa = _function(), ops.library().best_index  # type: ignore[union-attr]
        self.width, self.kv_heads, self.head_dim = C, KV, D
        post = w.post or (None, None)
        qk = w.qk_norm or (None, None)
        s = LmLayer(C, H, KV, D, F, ACTS.index(w.act), len(w.qkv), w.eps, w.qk_eps, w.scale)
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
        self.struct = s
        self.ref = ctypes.byref(s)

    def check_cache(self, k: Tensor, v: Tensor, rows: int) -> int:
        """The library's number for the cache's dtype, after checking that k and v are
        (rows, kv heads, columns, head size) contiguous CPU buffers of one dtype."""
        shape = (rows, self.kv_heads, k.size(2) if k.dim() == 4 else -1, self.head_dim)
        if k.shape != shape or v.shape != shape or k.dtype != v.dtype or k.dtype not in CACHE_TYPES:
            raise LmcliError(f"native layer: a cache of {k.dtype} {tuple(k.shape)} does not fit {shape}")
        if not (k.is_contiguous() and v.is_contiguous() and k.is_cpu and v.is_cpu):
            raise LmcliError("native layer: the cache must be contiguous CPU buffers")
        return CACHE_TYPES[k.dtype]

    def step(
        self,
        x: Tensor,
        rotary: tuple[Tensor, Tensor] | None,
        k: Tensor,
        v: Tensor,
        column: int,
        threads: int = 1,
        start: Tensor | None = None,
    ) -> None:
        """x (B, C) float32 <- the block's output; the new key and value go to ``column`` of the
        layer's cache k, v (B, KV, columns, D), and row b attends to columns start[b]..column
        (``start`` (B,) int64: each row's left padding; None: none); ``rotary``: cos and sin
        (B, D/2) float32, each row's turn at its new position (an angle a pair of dimensions), or
        None. Everything is checked here."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.size(1) != self.width or not x.is_contiguous():
            raise LmcliError(
                f"native layer: rows must be float32 (B, {self.width}), not {x.dtype} {tuple(x.shape)}"
            )
        B = x.size(0)
        cache = self.check_cache(k, v, B)
        if not 0 <= column < k.size(2):
            raise LmcliError(f"native layer: column {column} is outside the cache's {k.size(2)}")
        if start is not None:
            if (
                start.dtype != torch.int64
                or start.shape != (B,)
                or not (start.is_contiguous() and start.is_cpu)
            ):
                raise LmcliError(
                    f"native layer: start must be int64 ({B},), not {start.dtype} {tuple(start.shape)}"
                )
            if not 0 <= int(start.min()) <= int(start.max()) <= column:
                raise LmcliError(f"native layer: a row starts outside columns 0..{column}")
        turns = None
        if rotary is not None:
            half = self.head_dim // 2
            fits = [t.shape == (B, half) and t.dtype == torch.float32 and t.is_contiguous() for t in rotary]
            if not all(fits):
                raise LmcliError(f"native layer: the rotary table must be float32 rows ({B}, {half})")
            turns = (row_addresses(rotary[0]), row_addresses(rotary[1]))
        self.call(
            x.data_ptr(),
            B,
            turns,
            None if start is None else start.data_ptr(),
            (k.data_ptr(), v.data_ptr(), cache, k.size(2)),
            column,
            threads,
        )

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
        """``step`` for addresses its caller checked (a decoding step checks its rows, rotary rows
        and cache once for every layer): ``turns``, the addresses (B,) int64 of each row's cos
        and sin; ``cache``: (keys, values, the library's dtype number, columns)."""
        cos, sin = (None, None) if turns is None else (turns[0].data_ptr(), turns[1].data_ptr())
        k, v, dtype, columns = cache
        if self.fn(self.ref, x, rows, cos, sin, start, k, v, dtype, columns, column, threads, self.isa) != 0:
            raise LmcliError(f"native layer step refused its sizes (rows={rows}, column={column})")


def row_addresses(t: Tensor) -> Tensor:
    """(B,) int64: the address of each row of a contiguous (B, n) float32 tensor."""
    return torch.arange(t.size(0), dtype=torch.int64) * (t.size(1) * 4) + t.data_ptr()
