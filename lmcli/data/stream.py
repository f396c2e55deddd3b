"""A token stream in pieces: the memory-mapped shards of a token folder (or one array), each
with the positions of its documents' ``<eos>`` tokens, read, sliced and cut as one stream.

Training windows never cross a piece (``lmcli.data.windows``); a stream made of one array is
the token stream lmcli has always trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Piece:
    """Token ids (a memmap or an array) and the sorted positions of the ``<eos>`` that ends each
    document in them (int64; None when not known)."""

    tokens: np.ndarray
    eos: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, start: int, stop: int) -> Piece:
        """Tokens ``start .. stop-1``, with their documents' ends."""
        if self.eos is None:
            return Piece(self.tokens[start:stop])
        lo, hi = np.searchsorted(self.eos, [start, stop])
        return Piece(self.tokens[start:stop], self.eos[lo:hi] - start)


class TokenStream:
    """Pieces read as one stream of ``len(stream)`` tokens."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces = [p for p in pieces if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.pieces], dtype=np.int64)  # (P+1,)

    @classmethod
    def of(cls, tokens: np.ndarray, eos: np.ndarray | None = None) -> TokenStream:
        """One array as a stream (its documents' ends, if known)."""
        return cls([Piece(tokens, eos)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def dtype(self) -> np.dtype:
        return self.pieces[0].tokens.dtype if self.pieces else np.dtype("uint16")

    @property
    def has_documents(self) -> bool:
        """Whether every piece knows where its documents end."""
        return all(p.eos is not None for p in self.pieces)

    def locate(self, position: int) -> tuple[int, int]:
        """(piece, offset in it) of a position of the stream."""
        index = int(np.searchsorted(self.offsets, position, side="right")) - 1
        return index, position - int(self.offsets[index])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop-1`` as one array (copied when they span pieces)."""
        stop = min(stop, len(self))
        if start >= stop:
            return np.zeros(0, dtype=self.dtype)
        first, offset = self.locate(start)
        piece = self.pieces[first].tokens
        if offset + (stop - start) <= len(piece):
            return np.asarray(piece[offset : offset + stop - start])
        parts, at = [], start
        while at < stop:
            index, offset = self.locate(at)
            part = self.pieces[index].tokens[offset : offset + stop - at]
            parts.append(np.asarray(part))
            at += len(part)
        return np.concatenate(parts)

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        return self.read(start, stop)[::step]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read(0, len(self))  # a view of a memmap when the stream is one piece
        return np.array(out, dtype=dtype) if copy or dtype is not None else out

    def tolist(self) -> list[int]:
        return self.read(0, len(self)).tolist()

    def split(self, at: int) -> tuple[TokenStream, TokenStream]:
        """The tokens before ``at`` and from ``at`` on, as two streams."""
        head: list[Piece] = []
        tail: list[Piece] = []
        for piece, start in zip(self.pieces, self.offsets[:-1].tolist(), strict=True):
            cut = min(max(at - start, 0), len(piece))
            head.append(piece.cut(0, cut))
            tail.append(piece.cut(cut, len(piece)))
        return TokenStream(head), TokenStream(tail)
