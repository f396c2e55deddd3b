"""Preallocated key/value cache shared by eval, sampling and beam search.

Rows of the batch may be left-padded: ``start[b]`` is the first real column of row ``b``; the
model masks the columns before it and counts positions from it.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of every layer, ``(n_layer, B, n_head, max_len, head_dim)``."""

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
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # filled columns, the same for every row
        if start is None:
            start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.start = start.to(device=device, dtype=torch.long)

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

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    @property
    def has_padding(self) -> bool:
        return bool((self.start > 0).any())

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v`` of shape (B, H, T, D) after the filled columns; return all keys/values.

        The write is visible only once :meth:`advance` moves ``length`` on, after every layer ran.
        """
        end = self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.max_len} columns")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more columns as filled (called once per forward)."""
        self.length += n

    def positions(self, n: int) -> Tensor:
        """Position ids (B, n) of the next ``n`` columns: column minus the row's left padding."""
        cols = torch.arange(self.length, self.length + n, device=self.start.device)
        return (cols[None, :] - self.start[:, None]).clamp_min(0)

    def reorder(self, parent_idx: Tensor) -> None:
        """Keep row ``parent_idx[i]`` as new row ``i`` (beam search); the batch size may change."""
        parent_idx = parent_idx.to(self.k.device)
        self.k = self.k.index_select(1, parent_idx)
        self.v = self.v.index_select(1, parent_idx)
        self.start = self.start.index_select(0, parent_idx)

    def expand(self, n: int) -> None:
        """Repeat every row ``n`` times (row b becomes rows b*n .. b*n+n-1)."""
        self.reorder(torch.arange(self.batch_size, device=self.k.device).repeat_interleave(n))

    def reset(self, start: Tensor | None = None) -> None:
        """Empty the cache (e.g. before re-prefilling a sliding window)."""
        self.length = 0
        if start is not None:
            self.start = start.to(device=self.k.device, dtype=torch.long)
