"""Key/value cache shared by eval, sampling and beam search.

Rows of the batch may be left-padded: ``start[b]`` is the first real column of row ``b``; the
model masks the columns before it and counts positions from it.

The buffers grow with the filled length (by a quarter, at least ``GROW`` columns, up to
``max_len``), so a short generation never allocates or clears a whole context window, and a
beam-search reorder copies little more than the filled part (only what follows the prompt,
when the caller says the beams share it). What a step needs from ``start`` (is there padding,
the position ids, the padding mask) is derived once per ``start``, not at every step, and
without reading the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

GROW = 16  # the least number of columns added to the buffers at a time


class KVCache:
    """Keys and values of every layer, ``(n_layer, B, n_head, columns, head_dim)``."""

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
        self.step_plan: Any = None  # the model's decoding-step view of its weights (model.py)
        if start is None:
            start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._set_start(start.to(device=device, dtype=torch.long))

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
        """A cache sized for ``model`` (default length: its context window)."""
        cfg = model.config
        param = next(model.parameters())
        return cls(
            cfg.n_layer,
            batch_size,
            cfg.n_head,
            max_len or cfg.block_size,
            cfg.head_dim,
            device=param.device,
            dtype=dtype or param.dtype,
            start=start,
        )

    # ------------------------------------------------------------------ start and what follows

    def _set_start(self, start: Tensor, *, max_start: int | None = None) -> None:
        """Store ``start``; ``max_start`` (an upper bound of it) saves a host sync when known."""
        if max_start is None:
            max_start = int(start.max()) if start.numel() else 0
        self._start = start
        self.max_start = max_start
        self._positions: Tensor | None = None  # (B or 1, max_len) position id of every column
        self._pad_bias: Tensor | None = None  # (B, 1, 1, max_len): 0, or -inf before start

    @property
    def start(self) -> Tensor:
        return self._start

    @property
    def has_padding(self) -> bool:
        """True when some row starts after column 0 (known without reading the device)."""
        return self.max_start > 0

    def _position_table(self) -> Tensor:
        if self._positions is None:
            cols = torch.arange(self._max_len, device=self._start.device)
            if self.has_padding:
                self._positions = (cols[None, :] - self._start[:, None]).clamp_min(0)
            else:
                self._positions = cols[None, :]
        return self._positions

    def positions(self, n: int) -> Tensor:
        """Position ids (B or 1, n) of the next ``n`` columns: column minus the row's left padding."""
        table = self._position_table()
        if self.length + n > table.size(1):  # past the window (ALiBi needs no positions)
            cols = torch.arange(self.length, self.length + n, device=self._start.device)
            return (cols[None, :] - self._start[:, None]).clamp_min(0)
        return table[:, self.length : self.length + n]

    def padding_bias(self, n: int) -> Tensor:
        """Additive mask (B, 1, 1, n) for a query that sees columns ``0..n-1``: -inf before each
        row's start. Only valid when the query column is at or after every row's start."""
        if self._pad_bias is None:
            cols = torch.arange(self._max_len, device=self._start.device)
            blocked = cols[None, :] < self._start[:, None]
            bias = torch.zeros(blocked.shape, dtype=self.k.dtype, device=self.k.device)
            self._pad_bias = bias.masked_fill_(blocked, float("-inf"))[:, None, None, :]
        return self._pad_bias[..., :n]

    # ------------------------------------------------------------------ the buffers

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self._max_len

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
        positions, pad_bias = self._positions, self._pad_bias
        # a subset of rows starts no later than the latest start of all rows: no host sync
        self._set_start(self._start.index_select(0, parent_idx), max_start=self.max_start)
        if positions is not None:  # the derived tables follow their rows
            self._positions = positions if positions.size(0) == 1 else positions.index_select(0, parent_idx)
        if pad_bias is not None:
            self._pad_bias = pad_bias.index_select(0, parent_idx)

    def expand(self, n: int) -> None:
        """Repeat every row ``n`` times (row b becomes rows b*n .. b*n+n-1)."""
        self.reorder(torch.arange(self.batch_size, device=self.k.device).repeat_interleave(n))

    def reset(self, start: Tensor | None = None) -> None:
        """Empty the cache (e.g. before re-prefilling a sliding window)."""
        self.length = 0
        if start is not None:
            self._set_start(start.to(device=self.k.device, dtype=torch.long))
