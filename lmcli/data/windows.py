"""Training batches of a token stream: fixed-length windows, drawn without replacement.

A ``Batch`` is inputs (B, T) and targets (B, T), with ``IGNORE`` where no loss applies (and,
with ``--document-mask``, each input's document number in its window); ``WindowSampler`` draws
the training windows epoch after epoch from one position number, anywhere in the stream or
(``--align-documents``) at documents' starts, and ``eval_starts`` picks the fixed validation
windows. A window never crosses from one piece of a stream (a shard) into the next.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmcli.data.stream import TokenStream
from lmcli.device import Staging
from lmcli.errors import LmcliError

IGNORE = -100  # a target id the loss skips (F.cross_entropy's default ignore_index)


@dataclass
class Batch:
    """Inputs (B, T), targets (B, T) with IGNORE where no loss applies, optional prefix lengths (B,)
    and, when the loss reads only some positions, their flat indices (N,) into the (B * T) grid.

    ``tokens`` (B, T+1), when set, is the tensor ``x`` and ``y`` are views of (language modelling):
    it is copied to the device once and sliced there. ``document`` (B, T), when set, numbers the
    documents of each window's inputs (0, 1, ...): attention stays within a document.
    """

    x: torch.Tensor
    y: torch.Tensor
    prefix_len: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    index: torch.Tensor | None = None
    document: torch.Tensor | None = None

    def to(self, device: torch.device, staging: Staging | None = None) -> Batch:
        """The batch on ``device``; with ``staging``, copied through its pinned buffers."""

        def move(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
            if t is None:
                return None
            if staging is not None:
                return staging.to_device(t, name)
            if device.type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        prefix_len, index = move(self.prefix_len, "prefix_len"), move(self.index, "index")
        document = move(self.document, "document")
        if self.tokens is not None and (staging is not None or device.type != "cpu"):
            tokens = move(self.tokens, "tokens")  # (B, T+1) -> inputs (B, T) and targets (B, T), views
            return Batch(tokens[:, :-1], tokens[:, 1:], prefix_len, tokens, index, document)
        return Batch(move(self.x, "x"), move(self.y, "y"), prefix_len, index=index, document=document)

    @property
    def n_targets(self) -> int:
        return int((self.y != IGNORE).sum())


def require_window(n_tokens: int, block_size: int, what: str = "corpus") -> None:
    """Training needs at least one full window of ``block_size + 1`` tokens."""
    if n_tokens < block_size + 1:
        raise LmcliError(
            f"{what} has {n_tokens} tokens, fewer than one context window ({block_size} + 1): "
            "give more text or a smaller --block-size"
        )


class EpochStream:
    """Items drawn epoch after epoch, each epoch in its own seeded order (``order(epoch)``).

    The stream is cut into global batches; rank ``r`` of ``W`` takes its own slice of each, so
    ranks never share data. The position is one number, ``cursor`` (items consumed), so
    resuming, even at another world size, continues the same stream.
    """

    def __init__(self, n_items: int, seed: int) -> None:
        self.epoch_size = n_items  # items per epoch: windows, or pairs
        self.seed = seed
        self._epoch: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """What epoch ``epoch`` draws, in the order it draws it."""
        raise NotImplementedError

    def take(self, first: int, count: int) -> list[int]:
        """Items ``first .. first+count-1`` of the stream."""
        out = []
        for g in range(first, first + count):
            epoch, index = divmod(g, self.epoch_size)
            if self._epoch is None or self._epoch[0] != epoch:
                self._epoch = (epoch, self.order(epoch))
            out.append(int(self._epoch[1][index]))
        return out

    def epoch_of(self, cursor: int) -> float:
        return cursor / self.epoch_size


class WindowSampler(EpochStream):
    """Training batches drawn without replacement from the windows of a token stream.

    Each epoch visits every window once, in a seeded random order over the whole stream (every
    shard). Window ``k`` of a piece starts at ``k*T + jitter``, a seeded random shift in
    ``[0, T)`` that is new every epoch, so a token meets many positions and contexts across
    epochs. With ``align``, windows start at documents' starts instead (``aligned_starts``),
    without jitter; with ``grid``, at the starts of each piece's chunks of ``grid`` tokens and
    every ``T`` tokens within a chunk (``grid_starts``: where a teacher's logits were computed
    from), without jitter. With ``documents``, each batch numbers the documents of its windows.
    """

    def __init__(
        self,
        tokens: np.ndarray | TokenStream,
        block_size: int,
        seed: int,
        *,
        align: bool = False,
        documents: bool = False,
        grid: int = 0,
    ) -> None:
        stream = tokens if isinstance(tokens, TokenStream) else TokenStream.of(tokens)
        require_window(len(stream), block_size)
        if (align or documents) and not stream.has_documents:
            raise LmcliError("these tokens do not record where their documents end")
        self.stream, self.block_size, self.documents = stream, block_size, documents
        lengths = np.array([len(p) for p in stream.pieces], dtype=np.int64)
        self.last_start = lengths - 1 - block_size  # per piece: the latest start with a full window
        self.aligned: np.ndarray | None = None
        if align or grid:
            self.aligned = np.concatenate(
                [
                    offset
                    + (
                        grid_starts(len(p), block_size, grid)
                        if grid
                        else aligned_starts(p.eos, len(p), block_size)
                    )
                    for p, offset in self._pieces()
                ]
            )
            counts = np.array([len(self.aligned)], dtype=np.int64)
        else:
            counts = np.maximum((lengths - 1) // block_size, 0)
        self.first_window = np.concatenate([[0], np.cumsum(counts)])  # per piece, its first window
        if self.first_window[-1] == 0:
            raise LmcliError(
                f"no shard holds a context window ({block_size} + 1 tokens): give a smaller "
                "--block-size, or tokenize into larger shards"
            )
        super().__init__(int(self.first_window[-1]), seed)
        self.tokens = tokens  # what the sampler was given (a one-array stream: that array)

    def _pieces(self) -> list[tuple[Any, int]]:
        return list(zip(self.stream.pieces, self.stream.offsets[:-1].tolist(), strict=True))

    def order(self, epoch: int) -> np.ndarray:
        """Window starts (positions in the stream) of an epoch, in the order they are drawn."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.epoch_size)
        if self.aligned is not None:
            return self.aligned[order]
        jitter = rng.integers(0, self.block_size, size=self.epoch_size)
        piece = np.searchsorted(self.first_window, order, side="right") - 1
        local = (order - self.first_window[piece]) * self.block_size + jitter
        return self.stream.offsets[piece] + np.minimum(local, self.last_start[piece])

    def window_starts(self, first: int, count: int) -> list[int]:
        """Token offsets of windows ``first .. first+count-1`` of the global stream."""
        return self.take(first, count)

    def batch(self, first: int, count: int) -> Batch:
        """Inputs and targets, each (count, T), for windows ``first .. first+count-1``."""
        starts = self.window_starts(first, count)
        return windows_to_batch(self.stream, starts, self.block_size, documents=self.documents)


def aligned_starts(eos: np.ndarray, n_tokens: int, block_size: int) -> np.ndarray:
    """Window starts at documents' starts, tiling ``n_tokens`` tokens whose documents end at
    ``eos``: a window starts at the ``<eos>`` before a document (so the document's first token
    is a target), or at 0. Each next window starts at the last such start the window before it
    reached (re-reading the document it cut), or, in a document longer than the window, where
    that window ended."""
    last = n_tokens - 1 - block_size
    if last < 0:
        return np.zeros(0, dtype=np.int64)
    bounds = [0, *eos[eos <= last].tolist()]
    starts, s = [], 0
    while s <= last:
        starts.append(s)
        b = bounds[bisect.bisect_right(bounds, s + block_size) - 1]
        s = b if b > s else s + block_size
    return np.array(starts, dtype=np.int64)


def grid_starts(n_tokens: int, block_size: int, grid: int) -> np.ndarray:
    """Window starts in ``n_tokens`` tokens read in chunks of ``grid`` (``grid >= block_size``):
    each chunk's start and every ``block_size`` tokens after it while a window fits in the chunk's
    inputs; a window needs ``block_size + 1`` tokens of the piece."""
    per_chunk = np.arange(grid // block_size, dtype=np.int64) * block_size  # (W,)
    starts = (np.arange(0, n_tokens, grid, dtype=np.int64)[:, None] + per_chunk[None, :]).reshape(-1)
    return starts[starts <= n_tokens - 1 - block_size]


def document_ids(eos: np.ndarray, start: int, block_size: int) -> np.ndarray:
    """The document number (0, 1, ...) of each input of the window at ``start``: an ``<eos>``
    begins the next document (it stands where a document's ``<bos>`` would)."""
    positions = np.arange(start, start + block_size)
    return np.searchsorted(eos, positions, side="right") - np.searchsorted(eos, start, side="right")


def windows_to_batch(
    tokens: np.ndarray | TokenStream, starts: list[int], block_size: int, *, documents: bool = False
) -> Batch:
    """The windows starting at ``starts``: inputs and targets, views of one (B, T+1) tensor (and
    with ``documents``, each input's document number, (B, T))."""
    if isinstance(tokens, np.ndarray):
        rows = np.stack([np.asarray(tokens[s : s + block_size + 1], dtype=np.int64) for s in starts])
        data = torch.from_numpy(rows)  # (B, T+1)
        return Batch(data[:, :-1], data[:, 1:], tokens=data)
    located = [tokens.locate(s) for s in starts]
    rows = np.stack(
        [np.asarray(tokens.pieces[p].tokens[o : o + block_size + 1], dtype=np.int64) for p, o in located]
    )
    data = torch.from_numpy(rows)  # (B, T+1)
    document = None
    if documents:
        ids = [document_ids(tokens.pieces[p].eos, o, block_size) for p, o in located]
        document = torch.from_numpy(np.stack(ids))  # (B, T)
    return Batch(data[:, :-1], data[:, 1:], tokens=data, document=document)


def eval_windows(n_tokens: int, block_size: int, max_windows: int) -> list[int]:
    """Evenly spaced, non-overlapping validation windows (deterministic, the same every time)."""
    n_windows = (n_tokens - 1) // block_size
    if n_windows <= max_windows:
        return [k * block_size for k in range(n_windows)]
    picks = np.linspace(0, n_windows - 1, max_windows).round().astype(int)
    return [int(k) * block_size for k in picks]


def eval_starts(stream: TokenStream, block_size: int, max_windows: int, *, align: bool = False) -> list[int]:
    """The validation windows of a stream: evenly spaced among its non-overlapping windows (or
    its document-aligned ones), within pieces; for one piece, ``eval_windows``."""
    starts = []
    for piece, offset in zip(stream.pieces, stream.offsets[:-1].tolist(), strict=True):
        if align and piece.eos is not None:
            local = aligned_starts(piece.eos, len(piece), block_size).tolist()
        else:
            local = [k * block_size for k in range((len(piece) - 1) // block_size)]
        starts += [offset + s for s in local]
    if len(starts) <= max_windows:
        return starts
    picks = np.linspace(0, len(starts) - 1, max_windows).round().astype(int)
    return [starts[int(k)] for k in picks]
