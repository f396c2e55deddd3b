"""Key/value cache shared by eval, sampling and beam search, and the left padding of its rows.

``KVCache`` holds the buffers: keys and values of every layer, grown with the filled length
(by a quarter, at least ``GROW`` columns, up to ``max_len``), so a short generation never
allocates or clears a whole context window, and a beam-search reorder copies little more than
the filled part (only what follows the prompt, when the caller says the beams share it).

The buffers hold floats (``--kv-dtype`` float32, bfloat16, float16), or each head's row of
keys or values as ggml's 32-value blocks (``--kv-dtype q8_0|q4_0``, as llama.cpp's
``--cache-type-k/-v`` keeps them: ``lmcli.model.small_blocks``): new keys and values are rounded
to blocks as they are written, and a forward that attends reads them back as float32 values (a
native decoding step reads the blocks themselves).

A model with sliding-window layers may keep those layers' keys and values in a ring of a fixed
number of columns instead (``windows``, ``WindowRing``): the last W positions, plus ``slack``
columns a decoder may roll back (speculative decoding), so their memory stops growing with the
context; the ring says which of its columns each query may see (``window_mask``).

``LeftPadding`` holds where each row's text starts (``start[b]``, its first real column) and
what a step needs from it: whether there is padding at all, the position id of every column,
and the additive mask that hides the padding. They are derived once per ``start``, not at every
step, and without reading the device; rows that move in a reorder take them along.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lmcli.device import compute_dtype, memory_of
from lmcli.errors import LmcliError
from lmcli.model.small_blocks import BLOCK, BLOCK_BYTES, dequantize_rows, quantize_rows, row_bytes

if TYPE_CHECKING:
    from lmcli.config.model import ModelConfig

GROW = 16  # the least number of columns added to the buffers at a time
FORMATS = ("q8_0", "q4_0")  # the quantized caches' block formats (--kv-dtype)
KVDtype = torch.dtype | str  # a float dtype, or one of FORMATS


def value_bytes(dtype: KVDtype) -> float:
    """Bytes a cached value takes in ``dtype`` (a float dtype, or a block format: 34 / 32 for q8_0)."""
    if isinstance(dtype, str):
        return BLOCK_BYTES[dtype] / BLOCK
    return torch.empty((), dtype=dtype).element_size()


def kv_dtype(name: str) -> KVDtype | None:
    """``--kv-dtype``'s value as a cache holds it: a float dtype, a block format, or None (auto)."""
    if name in FORMATS or name == "auto":
        return None if name == "auto" else name
    return getattr(torch, name)


def check_format(dtype: KVDtype, head_dim: int) -> None:
    """One line unless a cache of ``dtype`` can hold heads of ``head_dim`` values."""
    if isinstance(dtype, str) and (dtype not in FORMATS or head_dim % BLOCK):
        raise LmcliError(
            f"--kv-dtype {dtype} keeps each head's keys in blocks of {BLOCK} values: this model's "
            f"heads have {head_dim}"
        )


def kv_bytes(cfg: ModelConfig, columns: int, itemsize: float, slack: int | None = 0) -> int:
    """Bytes of one row's keys and values over ``columns`` columns: ``n_kv_head * head_dim`` a
    column and layer, the sliding-window layers' ring (window + ``slack`` columns) where the
    cache keeps one (``KVCache.for_model`` with ``window_slack``; None: no ring)."""
    ring = cfg.sliding_window + (slack or 0)
    ringed = slack is not None and cfg.position != "alibi" and cfg.sliding_window > 0 and ring < columns
    cols = sum(ring if ringed and cfg.is_local(i) else columns for i in range(cfg.n_layer))
    return int(2 * cols * cfg.n_kv_head * cfg.head_dim * itemsize)


def cache_dtype(model: torch.nn.Module) -> KVDtype:
    """The dtype ``KVCache.for_model`` gives ``model``'s cache (``--kv-dtype``, else the compute
    dtype): a float dtype or a block format ("q8_0", "q4_0")."""
    param = next(model.parameters())
    return getattr(model, "kv_dtype", None) or compute_dtype(param.device, param.dtype)


def check_fits(model: torch.nn.Module, rows: int, what: str, columns: int | None = None) -> None:
    """Refuse with one line a decoding batch of ``rows`` rows whose KV cache (``columns`` a row,
    by default a full context; the sliding-window layers' ring) and next-token scores would not
    fit in the device's memory, before allocating any."""
    cfg = model.config
    param = next(model.parameters())
    itemsize = value_bytes(cache_dtype(model))
    per_row = (
        kv_bytes(cfg, min(columns or cfg.block_size, cfg.block_size), itemsize)
        + 4 * cfg.padded_vocab_size * 4
    )
    have = memory_of(param.device)
    if have is not None and rows * per_row > have:
        raise LmcliError(
            f"{what} needs {rows:,} rows of {per_row / 2**20:.1f} MiB for decoding, more than the "
            f"{have / 2**30:.1f} GiB of memory of {param.device.type}"
        )


class LeftPadding:
    """Each row's first real column in a left-padded batch, and the tables derived from it."""

    def __init__(self, start: Tensor, max_len: int, *, max_start: int | None = None) -> None:
        """``max_start`` (an upper bound of ``start``) saves a host sync when the caller knows it."""
        self.start = start
        self.max_len = max_len
        self.max_start = max_start if max_start is not None else (int(start.max()) if start.numel() else 0)
        self._positions: Tensor | None = None  # (B or 1, max_len) position id of every column
        self._bias: Tensor | None = None  # (B, 1, 1, max_len): 0, or -inf before start

    @property
    def has_padding(self) -> bool:
        """True when some row starts after column 0 (known without reading the device)."""
        return self.max_start > 0

    def positions(self, first: int, n: int) -> Tensor:
        """Position ids (B or 1, n) of columns ``first..first+n-1``: column minus the row's padding."""
        if first + n > self.max_len:  # past the window (ALiBi needs no table)
            cols = torch.arange(first, first + n, device=self.start.device)
            return (cols[None, :] - self.start[:, None]).clamp_min(0)
        if self._positions is None:
            cols = torch.arange(self.max_len, device=self.start.device)
            if self.has_padding:
                self._positions = (cols[None, :] - self.start[:, None]).clamp_min(0)
            else:
                self._positions = cols[None, :]
        return self._positions[:, first : first + n]

    def bias(self, n: int, dtype: torch.dtype) -> Tensor:
        """Additive mask (B, 1, 1, n) for a query that sees columns ``0..n-1``: -inf before each
        row's start. Only valid when the query column is at or after every row's start."""
        if self._bias is None or self._bias.dtype != dtype:
            cols = torch.arange(self.max_len, device=self.start.device)
            blocked = cols[None, :] < self.start[:, None]
            bias = torch.zeros(blocked.shape, dtype=dtype, device=self.start.device)
            self._bias = bias.masked_fill_(blocked, float("-inf"))[:, None, None, :]
        return self._bias[..., :n]

    def select(self, rows: Tensor) -> LeftPadding:
        """The padding of rows ``rows`` (B',), in that order, with the derived tables."""
        # a subset of rows starts no later than the latest start of all rows: no host sync
        out = LeftPadding(self.start.index_select(0, rows), self.max_len, max_start=self.max_start)
        if self._positions is not None:
            one = self._positions.size(0) == 1
            out._positions = self._positions if one else self._positions.index_select(0, rows)
        if self._bias is not None:
            out._bias = self._bias.index_select(0, rows)
        return out


class Rows:
    """How a cache holds a head's row of ``head_dim`` values: as a float dtype's values, or as
    ``fmt``'s blocks (``width`` bytes, uint8)."""

    def __init__(self, dtype: KVDtype, head_dim: int) -> None:
        check_format(dtype, head_dim)
        self.fmt = dtype if isinstance(dtype, str) else None
        self.head_dim = head_dim
        self.dtype = torch.uint8 if self.fmt else dtype  # the buffers'
        self.width = row_bytes(self.fmt, head_dim) if self.fmt else head_dim

    def stored(self, x: Tensor) -> Tensor:
        """New keys or values (..., D) as the buffers keep them."""
        return quantize_rows(x, self.fmt) if self.fmt else x.to(self.dtype)

    def values(self, b: Tensor) -> Tensor:
        """Rows of the buffers (..., width) as values (..., D): float32 from blocks, else themselves."""
        return dequantize_rows(b, self.fmt, self.head_dim) if self.fmt else b


class WindowRing:
    """Keys and values of the sliding-window layers, ``(n_local, B, n_kv_head, size, head_dim)``:
    column c of the sequence in slot c % size, the newest ``size`` columns kept (size >= window).

    A forward of T new columns writes them into their slots and attends over the whole ring when
    that overwrites no column its first query still sees (T <= size - window + 1: a decoding
    step, a short speculative check); a longer one (a prompt) attends over the columns it needs
    in order, the ring's last window - 1 columns and the new ones, and keeps the newest of them.
    """

    def __init__(self, layers: list[int], window: int, size: int, like: Tensor, rows: Rows) -> None:
        self.slot = {layer: i for i, layer in enumerate(layers)}  # model layer -> ring index
        self.window, self.size, self.rows = window, size, rows
        shape = (len(layers), like.size(1), like.size(2), size, like.size(4))
        self.k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.v = torch.zeros_like(self.k)
        self.high = 0  # the longest length the cache had: columns before high - size are gone
        self._plan: tuple[int, int, Tensor, Tensor | None] | None = None  # see ``slots``

    def in_place(self, T: int) -> bool:
        """Whether a forward of T new columns attends over the ring itself."""
        return T <= self.size - self.window + 1

    def key_columns(self, length: int, T: int) -> Tensor:
        """The sequence column (S,) of each key a forward of T new columns attends over: every
        slot's newest column (negative: never written), or the columns in order."""
        end = length + T
        if self.in_place(T):
            slots = torch.arange(self.size, device=self.k.device)
            return end - 1 - (end - 1 - slots) % self.size
        return torch.arange(max(0, length - self.window + 1), end, device=self.k.device)

    def slots(self, length: int, T: int) -> tuple[Tensor, Tensor | None]:
        """Where a forward of T new columns from ``length`` on writes the newest of them (those
        the ring keeps), and (when it does not attend over the ring itself) the slots of the
        columns before them it attends to; computed once per forward, for all local layers."""
        if self._plan is None or self._plan[:2] != (length, T):
            device = self.k.device
            n = min(T, self.size)  # the newest columns stay
            new = torch.arange(length + T - n, length + T, device=device) % self.size
            old = None
            if not self.in_place(T):
                old = torch.arange(max(0, length - self.window + 1), length, device=device) % self.size
            self._plan = (length, T, new, old)
        return self._plan[2], self._plan[3]

    def update(self, layer: int, length: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, KV, T, D) of columns length.. and return the keys and values to attend
        over, in the order of ``key_columns``."""
        i, T = self.slot[layer], k.size(2)
        keys, values = self.k[i], self.v[i]
        k, v = self.rows.stored(k), self.rows.stored(v)  # rounded as the ring keeps them
        new, old = self.slots(length, T)
        if old is None:  # the ring itself
            keys.index_copy_(2, new, k)
            values.index_copy_(2, new, v)
            return self.rows.values(keys), self.rows.values(values)
        all_k = torch.cat([keys.index_select(2, old), k], dim=2)  # (B, KV, S, row) in column order
        all_v = torch.cat([values.index_select(2, old), v], dim=2)
        keys.index_copy_(2, new, k[:, :, T - new.numel() :])
        values.index_copy_(2, new, v[:, :, T - new.numel() :])
        return self.rows.values(all_k), self.rows.values(all_v)

    def mask(self, length: int, T: int, start: Tensor | None) -> Tensor:
        """Boolean (B or 1, 1, T, S): query column q sees key column c when q - window < c <= q,
        c was written, and c is not a row's left padding (but q itself)."""
        cols = self.key_columns(length, T)[None, :]  # (1, S)
        q = torch.arange(length, length + T, device=cols.device)[:, None]  # (T, 1)
        allowed = (cols <= q) & (cols > q - self.window) & (cols >= 0)  # (T, S)
        if start is None:
            return allowed[None, None]
        seen = (cols[None] >= start[:, None, None]) | (cols == q)[None]  # (B, T, S)
        return (allowed[None] & seen).unsqueeze(1)

    def check_truncate(self, length: int) -> None:
        """A cut back to ``length`` must find the window before it still there."""
        if max(0, length - self.window + 1) < self.high - self.size:
            raise ValueError(
                f"cannot truncate a sliding-window cache to {length}: its ring of {self.size} columns "
                f"was written up to {self.high} (give it more slack)"
            )

    def reorder(self, parent_idx: Tensor) -> None:
        self._plan = None
        self.k = self.k.index_select(1, parent_idx)
        self.v = self.v.index_select(1, parent_idx)


class KVCache:
    """Keys and values of every layer, ``(n_layer, B, n_kv_head, columns, head_dim)``; with
    ``windows`` the sliding-window layers' in a ``WindowRing`` instead (``k`` and ``v`` then hold
    the other layers, in order)."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: KVDtype = torch.float32,
        start: Tensor | None = None,
        windows: tuple[list[int], int, int] | None = None,
    ) -> None:
        """``dtype``: a float dtype, or a block format of ``FORMATS`` (each head's row as its
        blocks); ``windows``: (the sliding-window layers, the window, the slack), their keys and
        values kept in a ring of window + slack columns."""
        self._max_len = max_len
        self.rows = Rows(dtype, head_dim)
        self.ring: WindowRing | None = None
        self.index = list(range(n_layer))  # model layer -> row of k and v (-1: in the ring)
        if windows is not None:
            local, window, slack = windows
            self.index = [-1] * n_layer
            for row, layer in enumerate(i for i in range(n_layer) if i not in local):
                self.index[layer] = row
            n_layer -= len(local)
        shape = (n_layer, batch_size, n_head, min(max_len, GROW), self.rows.width)
        self.k = torch.zeros(shape, device=device, dtype=self.rows.dtype)
        self.v = torch.zeros(shape, device=device, dtype=self.rows.dtype)
        self._spare: tuple[Tensor, Tensor] | None = None  # reorder targets, reused while the shape holds
        self.length = 0  # filled columns, the same for every row
        if start is None:
            start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.padding = LeftPadding(start.to(device=device, dtype=torch.long), max_len)
        if windows is not None:
            local, window, slack = windows
            self.ring = WindowRing(local, window, min(window + slack, max_len), self.k, self.rows)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        batch_size: int,
        *,
        max_len: int | None = None,
        start: Tensor | None = None,
        dtype: KVDtype | None = None,
        window_slack: int | None = None,
    ) -> KVCache:
        """A cache sized for ``model`` (default length: its context window), holding keys and values
        in ``dtype``, else the model's ``kv_dtype`` (``--kv-dtype``), else the dtype the forward
        computes them in (the autocast dtype under autocast, so no decoding step casts the whole
        cache; else the weights'). ``window_slack`` (not None):
        the sliding-window layers keep only their window, plus that many columns to roll back."""
        cfg = model.config
        param = next(model.parameters())
        max_len = max_len or cfg.block_size
        local = [i for i in range(cfg.n_layer) if cfg.is_local(i)]
        ringed = (
            window_slack is not None
            and bool(local)
            and cfg.position != "alibi"  # (its distances count columns in order)
            and cfg.sliding_window + window_slack < max_len
        )
        return cls(
            cfg.n_layer,
            batch_size,
            cfg.n_kv_head,  # grouped-query attention caches only the key/value heads
            max_len,
            cfg.head_dim,
            device=param.device,
            dtype=dtype or cache_dtype(model),
            start=start,
            windows=(local, cfg.sliding_window, window_slack) if ringed else None,
        )

    def ringed(self, model: torch.nn.Module, slack: int) -> KVCache:
        """This cache with its sliding-window layers' columns in a ring of window + ``slack``
        columns (their newest; the others' as they are), or itself when it has a ring already
        or ``for_model`` would make none."""
        out = KVCache.for_model(
            model, self.batch_size, max_len=self._max_len, dtype=self.dtype, window_slack=slack
        )
        if self.ring is not None or out.ring is None:
            return self
        held = [layer for layer, i in enumerate(out.index) if i >= 0]
        out.reserve(self.k.size(3))
        n = self.length
        out.k[:, :, :, :n] = self.k[held, :, :, :n]
        out.v[:, :, :, :n] = self.v[held, :, :, :n]
        cols = torch.arange(max(0, n - out.ring.size), n, device=self.k.device)
        local = list(out.ring.slot)  # model layers, in ring order
        out.ring.k[:, :, :, cols % out.ring.size] = self.k[local].index_select(3, cols)
        out.ring.v[:, :, :, cols % out.ring.size] = self.v[local].index_select(3, cols)
        out.length, out.ring.high, out.padding = n, n, self.padding
        return out

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def dtype(self) -> KVDtype:
        """What the cache holds: a float dtype, or a block format ("q8_0", "q4_0")."""
        return self.rows.fmt or self.k.dtype

    @property
    def fmt(self) -> str | None:
        """The block format of a quantized cache, None for a float one."""
        return self.rows.fmt

    @property
    def max_len(self) -> int:
        return self._max_len

    def positions(self, n: int) -> Tensor:
        """Position ids (B or 1, n) of the next ``n`` columns."""
        return self.padding.positions(self.length, n)

    def _grow(self, columns: int) -> None:
        """Make room for ``columns`` columns, keeping the filled ones."""
        size = max(columns, self.k.size(3) + max(GROW, self.k.size(3) // 4))
        size = min(self._max_len, -(-size // GROW) * GROW)
        shape = (*self.k.shape[:3], size, self.k.size(4))
        k = torch.empty(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.empty_like(k)
        k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
        v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
        self.k, self.v, self._spare = k, v, None

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` columns (at most ``max_len``) now, so that a decoder that knows
        how far it will go never has the buffers grow (and copied) along the way."""
        if min(columns, self._max_len) > self.k.size(3):
            self._grow(min(columns, self._max_len))

    def window_mask(self, T: int) -> Tensor | None:
        """The sliding-window layers' mask for a forward of T new columns when the ring holds
        them (``WindowRing.mask``), else None: their mask is the model's."""
        if self.ring is None:
            return None
        return self.ring.mask(self.length, T, self.padding.start if self.padding.has_padding else None)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v`` of shape (B, H, T, D) after the filled columns; return all keys/values.

        The write is visible only once :meth:`advance` moves ``length`` on, after every layer ran.
        """
        end = self.length + k.size(2)
        if end > self._max_len:
            raise ValueError(f"KV cache overflow: {end} > {self._max_len} columns")
        row = self.index[layer]
        if row < 0:  # a sliding-window layer's ring
            assert self.ring is not None
            return self.ring.update(layer, self.length, k, v)
        if end > self.k.size(3):
            self._grow(end)
        keys, values = self.k[row], self.v[row]
        keys.narrow(2, self.length, k.size(2)).copy_(self.rows.stored(k))
        values.narrow(2, self.length, k.size(2)).copy_(self.rows.stored(v))
        return self.rows.values(keys.narrow(2, 0, end)), self.rows.values(values.narrow(2, 0, end))

    def columns(self, row: int, first: int, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values ``(n_layer, n_kv_head, end - first, row)`` of every layer, in layer
        order, of filled columns ``first..end-1`` of row ``row`` (a sliding-window layer's from
        its ring, which must still hold them), as the buffers hold them (a row: ``head_dim``
        values, or a quantized cache's blocks)."""
        if self.ring is None:
            return self.k[:, row, :, first:end], self.v[:, row, :, first:end]
        if first < self.length - self.ring.size:
            raise ValueError(f"columns from {first} on are gone from the ring of {self.ring.size}")
        slots = torch.arange(first, end, device=self.k.device) % self.ring.size
        ks, vs = [], []
        for layer, i in enumerate(self.index):
            if i >= 0:
                ks.append(self.k[i, row, :, first:end])
                vs.append(self.v[i, row, :, first:end])
            else:
                j = self.ring.slot[layer]
                ks.append(self.ring.k[j, row].index_select(1, slots))
                vs.append(self.ring.v[j, row].index_select(1, slots))
        return torch.stack(ks), torch.stack(vs)

    def nbytes(self) -> int:
        """Bytes of the buffers, the ring's included."""
        held = [self.k, self.v] + ([self.ring.k, self.ring.v] if self.ring is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def advance(self, n: int) -> None:
        """Mark ``n`` more columns as filled (called once per forward)."""
        self.length += n
        if self.ring is not None:
            self.ring.high = max(self.ring.high, self.length)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` filled columns (speculative decoding drops the keys and
        values of rejected tokens; the next write goes over them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} columns to {length}")
        if self.ring is not None:
            self.ring.check_truncate(length)
        self.length = length

    def reorder(self, parent_idx: Tensor, shared: int = 0) -> None:
        """Keep row ``parent_idx[i]`` as new row ``i`` (beam search); the batch size may change.

        ``shared`` promises that the first ``shared`` columns of each new row's parent equal those
        of the row it replaces (the beams of one input share their prompt): while the batch keeps
        its size, only the columns after them are copied.
        """
        parent_idx = parent_idx.to(self.k.device)
        n = parent_idx.numel()
        if self._spare is not None and self._spare[0].size(1) == n:
            k, v = self._spare  # the previous buffers: their first ``shared`` columns still hold
            cols = slice(min(shared, self.length), self.length)
        else:
            shape = (self.k.size(0), n, *self.k.shape[2:])
            k, v = self.k.new_empty(shape), self.v.new_empty(shape)
            cols = slice(0, self.length)  # the unfilled columns need no copy
        torch.index_select(self.k[:, :, :, cols], 1, parent_idx, out=k[:, :, :, cols])
        torch.index_select(self.v[:, :, :, cols], 1, parent_idx, out=v[:, :, :, cols])
        self._spare = (self.k, self.v) if self.k.size(1) == n else None
        self.k, self.v = k, v
        self.padding = self.padding.select(parent_idx)
        if self.ring is not None:
            self.ring.reorder(parent_idx)

    def expand(self, n: int) -> None:
        """Repeat every row ``n`` times (row b becomes rows b*n .. b*n+n-1)."""
        self.reorder(torch.arange(self.batch_size, device=self.k.device).repeat_interleave(n))

    def reset(self, start: Tensor | None = None) -> None:
        """Empty the cache (e.g. before re-prefilling a sliding window)."""
        self.length = 0
        if self.ring is not None:
            self.ring.high = 0
        if start is not None:
            self.padding = LeftPadding(start.to(device=self.k.device, dtype=torch.long), self._max_len)
