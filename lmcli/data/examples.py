"""Supervised examples: token ids with a loss mask, cached, bucketed by length, collated.

Translation pairs (``<bos> source <sep> target <eos>``) and chat conversations (rendered with a
chat template) become the same thing: a token sequence, a flag per token saying whether the loss
reads it (the target, or every assistant reply and its end token), and a prefix length (the
tokens before the first scored one: the prompt). One cache holds them (a flat token file, a flat
mask file and an index of offsets, lengths and prefixes); ``ExampleSampler`` draws whole examples,
bucketed by length; ``collate`` pads them on the right and lists, on the host, the flat positions
the loss reads, so the model gathers those rows without a device-to-host sync. Compiled or on a
GPU, batch widths are multiples of 64 (of the context when it is shorter) so that shapes repeat
(no recompiles); a CPU in eager mode pads only to the longest example, as every extra column is
compute spent.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from lmcli.data.token_shards import damaged, file_check, read_cache_json
from lmcli.data.windows import IGNORE, Batch, EpochStream
from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write, remove_stale_temps, temp_file
from lmcli.text.tokenizer import Tokenizer

EXAMPLE_CACHE_VERSION = 1
PAD_MULTIPLE = 64  # compiled or on a GPU, batch widths are multiples of this (or of the context)


@dataclass
class ExampleStats:
    examples: int = 0  # examples kept
    empty: int = 0  # skipped: a side was empty (translation)
    truncated: int = 0  # cut to fit the context (kept, with the loss on what remains)
    beyond: int = 0  # skipped: not one scored token within the context (a prompt longer than it)


@dataclass
class Encoded:
    """One example: its token ids, which of them the loss reads, its prompt length, whether cut."""

    ids: list[int]
    scored: list[bool]
    prefix: int
    truncated: bool = False


Skipped = Literal["empty", "beyond"]  # why an example was left out (an ExampleStats counter)


class ExampleSource(Protocol):
    """Where examples come from: parallel text, or conversations."""

    description: str

    @property
    def key(self) -> str:
        """What identifies the source's content, for the cache."""
        ...

    def texts(self) -> Iterator[str]:
        """The text to train a tokenizer on."""
        ...

    def encoded(self, tok: Tokenizer, max_len: int) -> Iterator[Encoded | Skipped]:
        """Each example in at most ``max_len`` tokens, or why it was left out."""
        ...


def truncate(ids: list[int], scored: list[bool], max_len: int) -> Encoded | Skipped:
    """``ids`` cut to ``max_len`` tokens; "beyond" when no scored token is left within them."""
    cut = len(ids) > max_len
    ids, scored = ids[:max_len], scored[:max_len]
    if True not in scored:
        return "beyond"
    return Encoded(ids, scored, scored.index(True), cut)


# ----------------------------------------------------------------------------- the set and its cache


@dataclass
class ExampleSet:
    """Tokenized examples: ``tokens[offset[i] : offset[i] + length[i]]`` is example i, ``scored``
    (same layout, 0/1) marks the tokens the loss reads, ``prefix[i]`` is its prompt length."""

    tokens: np.ndarray
    scored: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    prefix: np.ndarray
    stats: ExampleStats = field(default_factory=ExampleStats)
    cached: bool = False

    def __len__(self) -> int:
        return len(self.offset)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offset[i] : self.offset[i] + self.length[i]]

    def mask(self, i: int) -> np.ndarray:
        return self.scored[self.offset[i] : self.offset[i] + self.length[i]]

    def subset(self, indices: np.ndarray) -> ExampleSet:
        return ExampleSet(
            self.tokens,
            self.scored,
            self.offset[indices],
            self.length[indices],
            self.prefix[indices],
            self.stats,
            self.cached,
        )


def tokenize_examples(source: ExampleSource, tok: Tokenizer, max_len: int, cache_dir: Path) -> ExampleSet:
    """Encode every example once (counting skipped and truncated ones) or reuse the cache."""
    template = tok.chat_template or ""  # a conversation's tokens depend on it
    key = hashlib.sha256(
        f"{EXAMPLE_CACHE_VERSION}:{source.key}:{tok.fingerprint}:{template}:{max_len}".encode()
    ).hexdigest()[:20]
    cache_dir = Path(cache_dir)
    paths = {ext: cache_dir / f"examples-{key}.{ext}" for ext in ("bin", "mask", "npy", "json")}
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    remove_stale_temps(cache_dir)
    cached = _reuse(paths, dtype)
    if cached is not None:
        return cached

    cache_dir.mkdir(parents=True, exist_ok=True)
    stats = ExampleStats()
    offsets: list[int] = []
    lengths: list[int] = []
    prefixes: list[int] = []
    n_tokens = 0
    temps: dict[str, Path] = {}
    try:
        temps["bin"], temps["mask"] = temp_file(paths["bin"]), temp_file(paths["mask"])
        with open(temps["bin"], "wb") as out, open(temps["mask"], "wb") as out_mask:
            for ex in source.encoded(tok, max_len):
                if isinstance(ex, str):  # left out: counted, reported by the caller
                    setattr(stats, ex, getattr(stats, ex) + 1)
                    continue
                stats.truncated += ex.truncated
                out.write(np.asarray(ex.ids, dtype=dtype).tobytes())
                out_mask.write(np.asarray(ex.scored, dtype=np.uint8).tobytes())
                offsets.append(n_tokens)
                lengths.append(len(ex.ids))
                prefixes.append(ex.prefix)
                n_tokens += len(ex.ids)
        stats.examples = len(offsets)
        if not offsets:
            raise LmcliError(f"no usable examples in {source.description}")
        index = np.asarray([offsets, lengths, prefixes], dtype=np.int64)  # (3, examples)
        temps["npy"] = temp_file(paths["npy"])
        with open(temps["npy"], "wb") as f:
            np.save(f, index)
        meta = {
            "n_tokens": n_tokens,
            "stats": stats.__dict__,
            "check": {ext: file_check(temps[ext]) for ext in ("bin", "mask", "npy")},
        }
        for ext in ("npy", "mask", "bin"):
            os.replace(temps[ext], paths[ext])
        atomic_write(paths["json"], json.dumps(meta))
    except OSError as exc:
        raise LmcliError(f"cannot write example cache in {cache_dir}: {exc.strerror}") from None
    finally:
        for path in temps.values():
            path.unlink(missing_ok=True)
    tokens = np.memmap(paths["bin"], dtype=dtype, mode="r")
    scored = np.memmap(paths["mask"], dtype=np.uint8, mode="r")
    return ExampleSet(tokens, scored, index[0], index[1], index[2], stats)


def _reuse(paths: dict[str, Path], dtype: str) -> ExampleSet | None:
    """The cached examples, or None (with a warning when a cache was there but is damaged)."""
    if not paths["json"].exists() and not paths["bin"].exists():
        return None
    meta = read_cache_json(paths["json"])
    check = meta.get("check") if meta is not None else None
    reason = "its .json is missing or unreadable"
    if meta is not None and not isinstance(check, dict):
        reason = "no checksum"
    elif meta is not None:
        reason = next(
            (r for ext in ("bin", "mask", "npy") if (r := damaged(paths[ext], {"check": check.get(ext)}))),
            None,
        )
        if reason is None:
            try:
                n = meta["n_tokens"]
                index = np.load(paths["npy"], allow_pickle=False)
                stats = ExampleStats(**meta["stats"])
                offset, length, prefix = index  # (3, examples)
                if not (
                    paths["bin"].stat().st_size == n * np.dtype(dtype).itemsize
                    and paths["mask"].stat().st_size == n
                    and index.dtype == np.int64
                    and index.ndim == 2
                    and (offset >= 0).all()
                    and (offset + length <= n).all()
                    and ((prefix >= 0) & (prefix < length)).all()
                ):
                    raise ValueError("index out of range")
                tokens = np.memmap(paths["bin"], dtype=dtype, mode="r")
                scored = np.memmap(paths["mask"], dtype=np.uint8, mode="r")
                return ExampleSet(tokens, scored, offset, length, prefix, stats, cached=True)
            except (OSError, ValueError, TypeError, KeyError):
                reason = "its index does not fit its tokens"
    print(f"warning: example cache {paths['bin']} is damaged ({reason}): rebuilding it", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------- batches


def pad_multiple(compiled: bool, device: torch.device) -> int:
    """What batch widths are multiples of: 64 when compiled or on a GPU (shapes repeat, kernels
    and compiled graphs are reused), else 1 (a CPU in eager mode gains nothing from padding)."""
    return PAD_MULTIPLE if compiled or device.type == "cuda" else 1


def batch_width(longest: int, context: int, multiple: int = 1) -> int:
    """The padded width of a batch whose longest input is ``longest``: a multiple of ``multiple``
    (of the context when it is shorter), at most the context."""
    multiple = min(multiple, context)
    return min(-(-longest // multiple) * multiple, context)


def collate(
    examples: ExampleSet, indices: list[int] | np.ndarray, pad_id: int, context: int, multiple: int = 1
) -> Batch:
    """Right-padded inputs, targets with IGNORE where the loss reads nothing, prompt lengths, and
    the flat positions (row * width + column) of the scored targets, all built on the host."""
    seqs = [np.asarray(examples.sequence(int(i)), dtype=np.int64) for i in indices]
    width = batch_width(max(len(s) for s in seqs) - 1, context, multiple)
    x = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    prefix = torch.empty(len(seqs), dtype=torch.long)
    for row, (i, seq) in enumerate(zip(indices, seqs, strict=True)):
        n = len(seq) - 1
        scored = torch.from_numpy(np.asarray(examples.mask(int(i))[1:], dtype=np.bool_))
        seq_t = torch.from_numpy(seq)
        x[row, :n] = seq_t[:-1]
        y[row, :n] = torch.where(scored, seq_t[1:], IGNORE)  # position j predicts token j + 1
        prefix[row] = int(examples.prefix[int(i)])
    index = (y.view(-1) != IGNORE).nonzero().squeeze(1)  # (N,) flat positions the loss reads
    return Batch(x, y, prefix, index=index)


class ExampleSampler(EpochStream):
    """Batches of whole examples, without replacement within an epoch, bucketed by length.

    Each epoch shuffles the examples (seeded), sorts them by length within pools of 32 batches,
    cuts the pools into batches and shuffles the batches, so a batch holds examples of similar
    length (little padding) while the order stays random. The position is examples consumed.
    """

    def __init__(
        self, examples: ExampleSet, batch_size: int, seed: int, pad_id: int, context: int, multiple: int = 1
    ) -> None:
        super().__init__(len(examples), seed)
        self.examples, self.batch_size, self.pad_id = examples, batch_size, pad_id
        self.context, self.multiple = context, multiple

    def order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.epoch_size)
        pool = 32 * self.batch_size
        pieces = []
        for start in range(0, len(perm), pool):
            chunk = perm[start : start + pool]
            chunk = chunk[np.argsort(self.examples.length[chunk], kind="stable")]
            pieces.extend(chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        order = rng.permutation(len(pieces))
        return np.concatenate([pieces[i] for i in order])

    def indices(self, first: int, count: int) -> list[int]:
        """Example indices ``first .. first+count-1`` of the stream."""
        return self.take(first, count)

    def batch(self, first: int, count: int) -> Batch:
        return collate(self.examples, self.indices(first, count), self.pad_id, self.context, self.multiple)
