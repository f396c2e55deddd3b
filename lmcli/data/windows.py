"""Training batches of a token stream: fixed-length windows, drawn without replacement.

A ``Batch`` is inputs (B, T) and targets (B, T), with ``IGNORE`` where no loss applies;
``WindowSampler`` draws the training windows epoch after epoch from one position number, and
``eval_windows`` picks the fixed validation windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmcli.device import Staging
from lmcli.errors import LmcliError

IGNORE = -100  # a target id the loss skips (F.cross_entropy's default ignore_index)


@dataclass
class Batch:
    """Inputs (B, T), targets (B, T) with IGNORE where no loss applies, optional prefix lengths (B,)
    and, when the loss reads only some positions, their flat indices (N,) into the (B * T) grid.

    ``tokens`` (B, T+1), when set, is the tensor ``x`` and ``y`` are views of (language modelling):
    it is copied to the device once and sliced there.
    """

    x: torch.Tensor
    y: torch.Tensor
    prefix_len: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    index: torch.Tensor | None = None

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
        if self.tokens is not None and (staging is not None or device.type != "cpu"):
            tokens = move(self.tokens, "tokens")  # (B, T+1) -> inputs (B, T) and targets (B, T), views
            return Batch(tokens[:, :-1], tokens[:, 1:], prefix_len, tokens, index)
        return Batch(move(self.x, "x"), move(self.y, "y"), prefix_len, index=index)

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
    """Training batches drawn without replacement from the corpus's windows.

    Each epoch visits every window index ``k`` once, in a seeded random order; window ``k`` starts
    at ``k*T + jitter``, a seeded random shift in ``[0, T)`` that is new every epoch, so a token
    meets many positions and contexts across epochs.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, seed: int) -> None:
        n = len(tokens)
        require_window(n, block_size)
        super().__init__((n - 1) // block_size, seed)
        self.tokens = tokens
        self.block_size = block_size
        self.last_start = n - 1 - block_size  # the latest start with a full window and target

    def order(self, epoch: int) -> np.ndarray:
        """Window starts of an epoch, in the order they are drawn."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.epoch_size)
        jitter = rng.integers(0, self.block_size, size=self.epoch_size)
        return np.minimum(order * self.block_size + jitter, self.last_start)

    def window_starts(self, first: int, count: int) -> list[int]:
        """Token offsets of windows ``first .. first+count-1`` of the global stream."""
        return self.take(first, count)

    def batch(self, first: int, count: int) -> Batch:
        """Inputs and targets, each (count, T), for windows ``first .. first+count-1``."""
        return windows_to_batch(self.tokens, self.window_starts(first, count), self.block_size)


def windows_to_batch(tokens: np.ndarray, starts: list[int], block_size: int) -> Batch:
    """The windows starting at ``starts``: inputs and targets, views of one (B, T+1) tensor."""
    rows = np.stack([np.asarray(tokens[s : s + block_size + 1], dtype=np.int64) for s in starts])
    data = torch.from_numpy(rows)  # (B, T+1)
    return Batch(data[:, :-1], data[:, 1:], tokens=data)


def eval_windows(n_tokens: int, block_size: int, max_windows: int) -> list[int]:
    """Evenly spaced, non-overlapping validation windows (deterministic, the same every time)."""
    n_windows = (n_tokens - 1) // block_size
    if n_windows <= max_windows:
        return [k * block_size for k in range(n_windows)]
    picks = np.linspace(0, n_windows - 1, max_windows).round().astype(int)
    return [int(k) * block_size for k in picks]
