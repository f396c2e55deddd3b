"""Key/value cache shared by eval, sampling and beam search, and the left padding of its rows.

``KVCache`` holds the buffers: keys and values of every layer, grown with the filled length
(by a quarter, at least ``GROW`` columns, up to ``max_len``), so a short generation never
allocates or clears a whole context window, and a beam-search reorder copies little more than
the filled part (only what follows the prompt, when the caller says the beams share it).

``LeftPadding`` holds where each row's text starts (``start[b]``, its first real column) and
what a step needs from it: whether there is padding at all, the position id of every column,
and the additive mask that hides the padding. They are derived once per ``start``, not at every
step, and without reading the device; rows that move in a reorder take them along.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmcli.device import compute_dtype, memory_of
from lmcli.errors import LmcliError

GROW = 16  # the least number of columns added to the buffers at a time


def check_fits(model: torch.nn.Module, rows: int, what: str) -> None:
    """Refuse with one line a decoding batch of ``rows`` rows whose KV cache (a full context per
    row) and next-token scores would not fit in the device's memory, before allocating any."""
    cfg = model.config
    param = next(model.parameters())
    per_row = (
        2 * cfg.n_layer * cfg.block_size * cfg.n_embd * param.element_size() + 4 * cfg.padded_vocab_size * 4
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


class KVCache:
    """Keys and values of every layer, ``(n_layer, B, n_kv_head, columns, head_dim)``."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        start: Tensor | None = None,
    ) -> None:
        self._max_len = max_len
        shape = (n_layer, batch_size, n_head, min(max_len, GROW), head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._spare: tuple[Tensor, Tensor] | None = None  # reorder targets, reused while the shape holds
        self.length = 0  # filled columns, the same for every row
        if start is None:
            start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.padding = LeftPadding(start.to(device=device, dtype=torch.long), max_len)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        batch_size: int,
        *,
        max_len: int | None = None,
        start: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A cache sized for ``model`` (default length: its context window), holding keys and values
        in the dtype the forward computes them in (default: the autocast dtype under autocast, so
        no decoding step casts the whole cache; else the weights')."""
        cfg = model.config
        param = next(model.parameters())
        return cls(
            cfg.n_layer,
            batch_size,
            cfg.n_kv_head,  # grouped-query attention caches only the key/value heads
            max_len or cfg.block_size,
            cfg.head_dim,
            device=param.device,
            dtype=dtype or compute_dtype(param.device, param.dtype),
            start=start,
        )

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

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

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v`` of shape (B, H, T, D) after the filled columns; return all keys/values.

        The write is visible only once :meth:`advance` moves ``length`` on, after every layer ran.
        """
        end = self.length + k.size(2)
        if end > self._max_len:
            raise ValueError(f"KV cache overflow: {end} > {self._max_len} columns")
        if end > self.k.size(3):
            self._grow(end)
        keys, values = self.k[layer], self.v[layer]
        keys.narrow(2, self.length, k.size(2)).copy_(k)
        values.narrow(2, self.length, k.size(2)).copy_(v)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def advance(self, n: int) -> None:
        """Mark ``n`` more columns as filled (called once per forward)."""
        self.length += n

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` filled columns (speculative decoding drops the keys and
        values of rejected tokens; the next write goes over them)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} columns to {length}")
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

    def expand(self, n: int) -> None:
        """Repeat every row ``n`` times (row b becomes rows b*n .. b*n+n-1)."""
        self.reorder(torch.arange(self.batch_size, device=self.k.device).repeat_interleave(n))

    def reset(self, start: Tensor | None = None) -> None:
        """Empty the cache (e.g. before re-prefilling a sliding window)."""
        self.length = 0
        if start is not None:
            self.padding = LeftPadding(start.to(device=self.k.device, dtype=torch.long), self._max_len)
