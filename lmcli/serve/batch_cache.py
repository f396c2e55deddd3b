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
"""

from __future__ import annotations

import torch

from lmcli.model.kv_cache import GROW, KVCache, LeftPadding


class BatchCache(KVCache):
    """A ``KVCache`` whose rows change between steps (see the module docstring)."""

    def relayout(self, keep: list[int], joining: list[tuple[KVCache, int]]) -> None:
        """Keep rows ``keep`` (in that order), then append ``copies`` rows of each prefilled
        single-row cache in ``joining``; every row right-aligned at the narrowest common width.
        One row joining no other (a request alone) keeps its cache's buffers as they are."""
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
            starts += [s + width - old_len for s in kept_starts]
        row = len(keep)
        for cache, copies in joining:
            p = cache.length
            k[:, row : row + copies, :, width - p : width] = cache.k[:, :1, :, :p]
            v[:, row : row + copies, :, width - p : width] = cache.v[:, :1, :, :p]
            starts += [width - p] * copies
            row += copies
        self.k, self.v, self._spare = k, v, None
        self.length = width
        start = torch.tensor(starts, dtype=torch.long, device=k.device)
        self.padding = LeftPadding(start, self._max_len, max_start=max(starts, default=0))

    def _adopt(self, cache: KVCache) -> bool:
        """Become ``cache`` (one row, no padding) without a copy, when it has room for a step."""
        if cache.batch_size != 1 or cache.padding.has_padding or cache.k.size(3) <= cache.length:
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
        self.k[:, row, :, width - p : width] = cache.k[:, 0, :, :p]
        self.v[:, row, :, width - p : width] = cache.v[:, 0, :, :p]
        starts = self.padding.start.tolist()
        starts[row] = width - p
        start = torch.tensor(starts, dtype=torch.long, device=self.k.device)
        self.padding = LeftPadding(start, self._max_len, max_start=max(starts))

    def room(self) -> int:
        """Columns left before the window is full."""
        return self._max_len - self.length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def empty_cache(model: torch.nn.Module) -> BatchCache:
    """A batched cache of no rows for ``model``."""
    return BatchCache.for_model(model, 0)
