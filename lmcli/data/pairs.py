"""Parallel text for decoder-only translation: pairs in, ``<bos> source <sep> target <eos>`` out.

Pairs come from two line-aligned files (``--source``/``--target``, ``.gz`` allowed), one TSV or
JSONL file, or a ``datasets`` corpus whose rows hold a translation. Each pair is tokenized once
into a cache (a flat token file plus an index of offsets and source lengths). Batches are whole
pairs, bucketed by length, padded on the right; targets of source positions are ``IGNORE`` so
the loss covers target tokens only.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmcli.data.corpus import READ_ERRORS, batched, load_hf_dataset, open_text, read_error
from lmcli.data.token_cache import damaged, file_check, read_cache_json
from lmcli.data.windows import IGNORE, Batch, EpochStream
from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write, remove_stale_temps, temp_file
from lmcli.tokenizer import Tokenizer

PAIR_CACHE_VERSION = 1


@dataclass
class PairStats:
    pairs: int = 0  # pairs kept
    empty: int = 0  # pairs skipped because a side was empty
    truncated: int = 0  # pairs cut to fit the context


def _count_lines(path: Path) -> int:
    try:
        with open_text(path) as f:
            return sum(1 for _ in f)
    except READ_ERRORS as exc:
        raise LmcliError(read_error(path, exc)) from None


class PairCorpus:
    """A re-iterable source of (source, target) text pairs with a cache identity."""

    def __init__(self, identity: dict[str, Any], description: str) -> None:
        self.identity = identity
        self.description = description

    def pairs(self) -> Iterator[tuple[str, str]]:
        raise NotImplementedError

    def texts(self) -> Iterator[str]:
        """Both sides, for training a joint tokenizer."""
        for src, tgt in self.pairs():
            yield src
            yield tgt

    @property
    def key(self) -> str:
        blob = json.dumps(self.identity, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _file_id(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


class AlignedFiles(PairCorpus):
    """Two line-aligned files: line i of ``source`` translates to line i of ``target``."""

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = Path(source), Path(target)
        for p in (self.source, self.target):
            if not p.is_file():
                raise LmcliError(f"no such file: {p}")
        n_src, n_tgt = _count_lines(self.source), _count_lines(self.target)
        if n_src != n_tgt:
            raise LmcliError(
                f"source and target differ in length: {self.source} has {n_src} lines, "
                f"{self.target} has {n_tgt}"
            )
        super().__init__(
            {"source": _file_id(self.source), "target": _file_id(self.target)},
            f"{self.source} -> {self.target} ({n_src} lines)",
        )

    def pairs(self) -> Iterator[tuple[str, str]]:
        try:
            with open_text(self.source) as fs, open_text(self.target) as ft:
                for src, tgt in zip(fs, ft, strict=True):
                    yield src.rstrip("\n"), tgt.rstrip("\n")
        except READ_ERRORS as exc:
            raise LmcliError(read_error(f"{self.source} or {self.target}", exc)) from None


class TableFile(PairCorpus):
    """One TSV (``source<TAB>target``) or JSONL (``{"source": ..., "target": ...}``) file."""

    def __init__(self, path: str, source_column: str = "source", target_column: str = "target") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise LmcliError(f"no such file: {self.path}")
        self.columns = (source_column, target_column)
        self.jsonl = ".jsonl" in self.path.suffixes or ".json" in self.path.suffixes
        super().__init__({"table": _file_id(self.path), "columns": self.columns}, f"{self.path}")

    def pairs(self) -> Iterator[tuple[str, str]]:
        try:
            yield from self._rows()
        except READ_ERRORS as exc:
            raise LmcliError(read_error(self.path, exc)) from None

    def _rows(self) -> Iterator[tuple[str, str]]:
        with open_text(self.path) as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    yield "", ""
                    continue
                if self.jsonl:
                    try:
                        row = json.loads(line)
                        yield str(row[self.columns[0]]), str(row[self.columns[1]])
                    except (ValueError, KeyError, TypeError):
                        raise LmcliError(
                            f"{self.path}:{number}: expected a JSON object with "
                            f"{self.columns[0]!r} and {self.columns[1]!r}"
                        ) from None
                else:
                    parts = line.split("\t")
                    if len(parts) != 2:
                        raise LmcliError(f"{self.path}:{number}: expected source<TAB>target")
                    yield parts[0], parts[1]


class DatasetPairs(PairCorpus):
    """A ``datasets`` corpus: a ``translation`` column of {lang: text}, or two text columns."""

    def __init__(self, spec: str, split: str, source: str, target: str) -> None:
        self.dataset = load_hf_dataset(spec, split)
        cols = self.dataset.column_names
        if "translation" in cols:
            self.mode = "translation"
        elif source in cols and target in cols:
            self.mode = "columns"
        else:
            raise LmcliError(
                f"dataset {spec} has neither a 'translation' column nor columns {source!r} and "
                f"{target!r} (columns: {', '.join(cols)})"
            )
        self.source, self.target = source, target
        super().__init__(
            {
                "dataset": spec,
                "split": split,
                "fields": [source, target],
                "fingerprint": getattr(self.dataset, "_fingerprint", None),
            },
            f"dataset {spec} [{split}] ({len(self.dataset)} rows)",
        )

    def pairs(self) -> Iterator[tuple[str, str]]:
        for row in self.dataset:
            if self.mode == "translation":
                tr = row["translation"] or {}
                if self.source not in tr or self.target not in tr:
                    raise LmcliError(
                        f"translation rows need languages {self.source!r} and {self.target!r}, "
                        f"found {', '.join(tr)}: set --source-lang and --target-lang"
                    )
                yield tr[self.source] or "", tr[self.target] or ""
            else:
                yield row[self.source] or "", row[self.target] or ""


# ----------------------------------------------------------------------------- tokenized pairs


@dataclass
class PairSet:
    """Tokenized pairs: ``tokens[offset[i] : offset[i] + length[i]]`` is pair i's sequence."""

    tokens: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    prefix: np.ndarray  # columns of <bos> source <sep>: what the loss ignores
    stats: PairStats = field(default_factory=PairStats)
    cached: bool = False

    def __len__(self) -> int:
        return len(self.offset)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offset[i] : self.offset[i] + self.length[i]]

    def subset(self, indices: np.ndarray) -> PairSet:
        return PairSet(
            self.tokens,
            self.offset[indices],
            self.length[indices],
            self.prefix[indices],
            self.stats,
            self.cached,
        )


def encode_pair(src: list[int], tgt: list[int], tok: Tokenizer, max_len: int) -> tuple[list[int], int, bool]:
    """``<bos> src <sep> tgt <eos>`` in at most ``max_len`` tokens; (ids, prefix length, truncated).

    Too long: the source keeps at most half the room (more if the target is short) and the target
    the rest, without ``<eos>`` when it was cut, so the model never learns to stop early.
    """
    if tok.sep_id is None:
        raise LmcliError("the tokenizer has no <sep> token, which translation needs")
    room = max_len - 3  # <bos>, <sep>, <eos>
    truncated = len(src) + len(tgt) > room
    if truncated:
        n_src = min(len(src), max(room - len(tgt), room // 2))
        src = src[:n_src]
        tgt = tgt[: room + 1 - n_src]  # the <eos> slot goes to target text
        ids = [tok.bos_id, *src, tok.sep_id, *tgt]
    else:
        ids = [tok.bos_id, *src, tok.sep_id, *tgt, tok.eos_id]
    return ids, len(src) + 2, truncated


def source_prompt(src: list[int], tok: Tokenizer, max_len: int) -> list[int]:
    """The decoding prompt ``<bos> source <sep>``, the source cut to half the context."""
    if tok.sep_id is None:
        raise LmcliError("the tokenizer has no <sep> token, which translation needs")
    return [tok.bos_id, *src[: max(max_len // 2 - 2, 1)], tok.sep_id]


def tokenize_pairs(
    corpus: PairCorpus, tok: Tokenizer, max_len: int, cache_dir: Path, chunk: int = 10_000
) -> PairSet:
    """Tokenize every pair once (skipping empty ones, truncating long ones) or reuse the cache."""
    key = hashlib.sha256(
        f"{PAIR_CACHE_VERSION}:{corpus.key}:{tok.fingerprint}:{max_len}".encode()
    ).hexdigest()[:20]
    cache_dir = Path(cache_dir)
    bin_path, idx_path = cache_dir / f"pairs-{key}.bin", cache_dir / f"pairs-{key}.json"
    npy_path = cache_dir / f"pairs-{key}.npy"
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    remove_stale_temps(cache_dir)
    cached = _reuse_pairs(bin_path, idx_path, npy_path, dtype)
    if cached is not None:
        return cached

    cache_dir.mkdir(parents=True, exist_ok=True)
    stats = PairStats()
    offsets: list[int] = []
    lengths: list[int] = []
    prefixes: list[int] = []
    n_tokens = 0
    tmp = tmp_npy = None
    try:
        tmp = temp_file(bin_path)
        with open(tmp, "wb") as out:
            for batch in batched(corpus.pairs(), chunk):
                kept = [(s, t) for s, t in batch if s.strip() and t.strip()]
                stats.empty += len(batch) - len(kept)
                if not kept:
                    continue
                srcs = tok.encode_batch([s for s, _ in kept])
                tgts = tok.encode_batch([t for _, t in kept])
                for s_ids, t_ids in zip(srcs, tgts, strict=True):
                    ids, prefix, cut = encode_pair(s_ids, t_ids, tok, max_len)
                    stats.truncated += cut
                    out.write(np.asarray(ids, dtype=dtype).tobytes())
                    offsets.append(n_tokens)
                    lengths.append(len(ids))
                    prefixes.append(prefix)
                    n_tokens += len(ids)
        stats.pairs = len(offsets)
        if not offsets:
            raise LmcliError(f"no non-empty pairs in {corpus.description}")
        index = np.asarray([offsets, lengths, prefixes], dtype=np.int64)
        tmp_npy = temp_file(npy_path)
        with open(tmp_npy, "wb") as f:
            np.save(f, index)
        meta = {
            "n_tokens": n_tokens,
            "stats": stats.__dict__,
            "check": {"tokens": file_check(tmp), "index": file_check(tmp_npy)},
        }
        os.replace(tmp_npy, npy_path)
        os.replace(tmp, bin_path)
        atomic_write(idx_path, json.dumps(meta))
    except OSError as exc:
        raise LmcliError(f"cannot write pair cache in {cache_dir}: {exc.strerror}") from None
    finally:
        for path in (tmp, tmp_npy):
            if path is not None:
                path.unlink(missing_ok=True)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    return PairSet(tokens, index[0], index[1], index[2], stats)


def _reuse_pairs(bin_path: Path, idx_path: Path, npy_path: Path, dtype: str) -> PairSet | None:
    """The cached pairs, or None (with a warning when a cache was there but is damaged)."""
    if not idx_path.exists() and not bin_path.exists():
        return None
    meta = read_cache_json(idx_path)
    check = meta.get("check") if meta is not None else None
    reason = "its .json is missing or unreadable"
    if meta is not None and not isinstance(check, dict):
        reason = "no checksum (written by an older lmcli)"
    elif meta is not None:
        reason = damaged(bin_path, {"check": check.get("tokens")}) or damaged(
            npy_path, {"check": check.get("index")}
        )
        if reason is None:
            try:
                n = meta["n_tokens"]
                index = np.load(npy_path, allow_pickle=False)
                stats = PairStats(**meta["stats"])
                offset, length, prefix = index  # (3, pairs)
                if not (
                    bin_path.stat().st_size == n * np.dtype(dtype).itemsize
                    and index.dtype == np.int64
                    and index.ndim == 2
                    and (offset >= 0).all()
                    and (offset + length <= n).all()
                    and ((prefix >= 2) & (prefix <= length)).all()
                ):
                    raise ValueError("index out of range")
                tokens = np.memmap(bin_path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
                return PairSet(tokens, offset, length, prefix, stats, cached=True)
            except (OSError, ValueError, TypeError, KeyError):
                reason = "its index does not fit its tokens"
    print(f"warning: pair cache {bin_path} is damaged ({reason}): rebuilding it", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------- batches


def collate(pairs: PairSet, indices: list[int] | np.ndarray, pad_id: int) -> Batch:
    """Right-padded inputs and source-masked targets for the pairs at ``indices``."""
    seqs = [pairs.sequence(int(i)) for i in indices]
    width = max(len(s) for s in seqs) - 1
    x = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    prefix = torch.empty(len(seqs), dtype=torch.long)
    for row, (i, seq) in enumerate(zip(indices, seqs, strict=True)):
        seq_t = torch.from_numpy(np.asarray(seq, dtype=np.int64))
        n, p = len(seq) - 1, int(pairs.prefix[int(i)])
        x[row, :n] = seq_t[:-1]
        y[row, :n] = seq_t[1:]
        y[row, : p - 1] = IGNORE  # positions predicting source tokens and <sep>
        prefix[row] = p
    return Batch(x, y, prefix)


class PairSampler(EpochStream):
    """Batches of whole pairs, without replacement within an epoch, bucketed by length.

    Each epoch shuffles the pairs (seeded), sorts them by length within pools of 32 batches,
    cuts the pools into batches and shuffles the batches, so a batch holds pairs of similar length
    (little padding) while the order stays random. The position is pairs consumed.
    """

    def __init__(self, pairs: PairSet, batch_size: int, seed: int, pad_id: int) -> None:
        super().__init__(len(pairs), seed)
        self.pairs, self.batch_size, self.pad_id = pairs, batch_size, pad_id

    def order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.epoch_size)
        pool = 32 * self.batch_size
        pieces = []
        for start in range(0, len(perm), pool):
            chunk = perm[start : start + pool]
            chunk = chunk[np.argsort(self.pairs.length[chunk], kind="stable")]
            pieces.extend(chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        order = rng.permutation(len(pieces))
        return np.concatenate([pieces[i] for i in order])

    def indices(self, first: int, count: int) -> list[int]:
        """Pair indices ``first .. first+count-1`` of the stream."""
        return self.take(first, count)

    def batch(self, first: int, count: int) -> Batch:
        return collate(self.pairs, self.indices(first, count), self.pad_id)
