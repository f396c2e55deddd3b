"""The batched KV cache of continuous batching: rows join and leave between decoding steps.

It is lmcli's ``KVCache`` (the one the model's forward reads and writes), whose rows are laid
out right-aligned: every row's text ends at the last filled column, and ``padding.start[b]`` is
where row ``b``'s text begins. A row's position ids are its column minus its start, so a prompt
prefilled on its own (positions 0..P-1) can be copied in as it is, and a row decodes with the
same positions, keys and values as it would alone.

``relayout`` is the one operation that changes the rows: it keeps some rows, appends new ones
(the keys/values of prompts prefilled alone), and places them all at the least common width,
shifting the kept rows left when the rows that started earliest have left. The first row then
always starts at column 0, so a request alone in the batch has no padding at all, exactly as
``lmcli sample`` runs it.

A model's sliding-window layers keep their keys and values in the cache's ring
(``WindowRing``): the last window + ``RING_SLACK`` columns of every row, so the batch's memory
for those layers does not grow with the context. Column c of the batch lives in slot
c % size for every row; a relayout that moves a row's columns turns its ring with them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmcli.generate.prefix_cache import BLOCK
from lmcli.model.kv_cache import GROW, KVCache, LeftPadding

# the ring's columns past the window: a prefix-cache block, so that a row's newest whole block
# is still there when it is complete (``Engine`` caches it then)
RING_SLACK = BLOCK


class BatchCache(KVCache):
    """A ``KVCache`` whose rows change between steps (see the module docstring)."""

    def _held(self, t: Tensor) -> Tensor:
        """The layers of a plain cache's ``k`` or ``v`` (n_layer, ...) that this cache's ``k``
        holds: all of them, or those not in the ring."""
        if self.ring is None:
            return t
        return t[[layer for layer, i in enumerate(self.index) if i >= 0]]

    def _into_ring(self, k: Tensor, v: Tensor, rows: slice, cache: KVCache, offset: int) -> None:
        """Write the sliding-window layers' newest columns of a plain single-row ``cache`` into
        rows ``rows`` of the ring buffers ``k, v`` (n_local, B, KV, size, D), its column c
        becoming column ``offset + c`` (in slot ``(offset + c) % size``)."""
        assert self.ring is not None and cache.ring is None
        p, size = cache.length, self.ring.size
        cols = torch.arange(max(0, p - size), p, device=k.device)
        slots = (cols + offset) % size
        local = list(self.ring.slot)  # model layers, in ring order
        k[:, rows, :, slots] = cache.k[local, :1].index_select(3, cols)  # (n_local, 1, KV, n, D)
        v[:, rows, :, slots] = cache.v[local, :1].index_select(3, cols)

    def relayout(self, keep: list[int], joining: list[tuple[KVCache, int]]) -> None:
        """Keep rows ``keep`` (in that order), then append ``copies`` rows of each prefilled
        single-row cache in ``joining``; every row right-aligned at the narrowest common width.
        One row joining no other (a request alone) keeps its cache's buffers as they are.

        With a ring (sliding-window layers) the kept rows' ring turns with their columns, and a
        joining row brings the newest ``ring.size`` columns of those layers only."""
        if not keep and len(joining) == 1 and joining[0][1] == 1 and self._adopt(joining[0][0]):
            return
        old_len = self.length
        kept_starts = self.padding.start[keep].tolist() if keep else []
        first = min(kept_starts, default=old_len)  # the earliest column any kept row still uses
        width = max([old_len - first] + [c.length for c, _ in joining])  # L'
        rows = len(keep) + sum(n for _, n in joining)
        n_layer, _, n_head, columns, head_dim = self.k.shape
        columns = min(self._max_len, max(columns, width + GROW))
        # zeros: the padding columns must hold finite values (they are masked, not skipped)
        k = self.k.new_zeros((n_layer, rows, n_head, columns, head_dim))
        v = torch.zeros_like(k)
        ring = self.ring
        if ring is not None:
            ring_k = ring.k.new_zeros((ring.k.size(0), rows, *ring.k.shape[2:]))  # (n_local, B', KV, size, D)
            ring_v = torch.zeros_like(ring_k)
        starts: list[int] = []
        if keep:
            n = min(old_len, width)  # the columns that move: [old_len - n, old_len) -> [width - n, width)
            idx = torch.tensor(keep, device=self.k.device)
            k[:, : len(keep), :, width - n : width] = self.k[:, :, :, old_len - n : old_len].index_select(
                1, idx
            )
            v[:, : len(keep), :, width - n : width] = self.v[:, :, :, old_len - n : old_len].index_select(
                1, idx
            )
            if ring is not None:  # column c moves to c + width - old_len: its slot turns with it
                ring_k[:, : len(keep)] = ring.k.index_select(1, idx).roll(width - old_len, dims=3)
                ring_v[:, : len(keep)] = ring.v.index_select(1, idx).roll(width - old_len, dims=3)
            starts += [s + width - old_len for s in kept_starts]
        row = len(keep)
        for cache, copies in joining:
            p = cache.length
            k[:, row : row + copies, :, width - p : width] = self._held(cache.k)[:, :1, :, :p]
            v[:, row : row + copies, :, width - p : width] = self._held(cache.v)[:, :1, :, :p]
            if ring is not None:
                self._into_ring(ring_k, ring_v, slice(row, row + copies), cache, width - p)
            starts += [width - p] * copies
            row += copies
        self.k, self.v, self._spare = k, v, None
        self.length = width
        if ring is not None:
            ring.k, ring.v, ring.high, ring._plan = ring_k, ring_v, width, None
        start = torch.tensor(starts, dtype=torch.long, device=k.device)
        self.padding = LeftPadding(start, self._max_len, max_start=max(starts, default=0))

    def _adopt(self, cache: KVCache) -> bool:
        """Become ``cache`` (one row, no padding) without a copy, when it has room for a step
        and the same layout (no ring here and there)."""
        if cache.batch_size != 1 or cache.padding.has_padding or cache.k.size(3) <= cache.length:
            return False
        if self.ring is not None or cache.ring is not None:
            return False
        self.k, self.v, self._spare, self.length = cache.k, cache.v, None, cache.length
        self.padding = LeftPadding(cache.padding.start, self._max_len, max_start=0)
        return True

    def fill(self, row: int, cache: KVCache) -> None:
        """Put a prefilled single-row cache into row ``row`` (a hole) in place; its prompt must
        be no longer than the filled columns."""
        p, width = cache.length, self.length
        self.k[:, row, :, : width - p] = 0
        self.v[:, row, :, : width - p] = 0
        self.k[:, row, :, width - p : width] = self._held(cache.k)[:, 0, :, :p]
        self.v[:, row, :, width - p : width] = self._held(cache.v)[:, 0, :, :p]
        if self.ring is not None:
            self.ring.k[:, row] = 0
            self.ring.v[:, row] = 0
            self._into_ring(self.ring.k, self.ring.v, slice(row, row + 1), cache, width - p)
        starts = self.padding.start.tolist()
        starts[row] = width - p
        start = torch.tensor(starts, dtype=torch.long, device=self.k.device)
        self.padding = LeftPadding(start, self._max_len, max_start=max(starts))

    def room(self) -> int:
        """Columns left before the window is full."""
        return self._max_len - self.length


def empty_cache(model: torch.nn.Module) -> BatchCache:
    """A batched cache of no rows for ``model``: its sliding-window layers in a ring of their
    window plus ``RING_SLACK`` columns."""
    return BatchCache.for_model(model, 0, window_slack=RING_SLACK)
