"""Corpora in, token ids out: readers, a streaming tokenizer cache, and batch sampling.

A corpus is files, folders (recursive), globs, ``.gz`` files, a Hugging Face ``datasets`` name,
or the built-in default (CPython's own documentation text, ``pydoc_data.topics``). Each document
is tokenized once, in chunks, into a uint16/uint32 file under the cache folder, keyed by a hash
of the corpus and the tokenizer; a second run memory-maps it instead of tokenizing again.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmcli.errors import LmcliError
from lmcli.tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20  # read and tokenize about 1 MiB at a time
PIECE_CHARS = 1 << 12  # encode_batch items: 2-4 KiB pieces encode ~30% faster than lines or 64 KiB
CACHE_VERSION = 2  # 2: 4 KiB pieces cut at a line break, else before a space


@dataclass
class TextStats:
    """What reading a corpus found: sizes, and invalid UTF-8 replaced by U+FFFD."""

    documents: int = 0
    bytes: int = 0
    replaced: int = 0  # invalid UTF-8 sequences replaced
    skipped_binary: int = 0  # files skipped because they look binary


# ----------------------------------------------------------------------------- sources


def _is_hidden(path: Path) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in path.parts)


def resolve_paths(patterns: tuple[str, ...] | list[str]) -> list[Path]:
    """Expand files, folders (recursive, hidden entries skipped) and globs into sorted files."""
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not _is_hidden(p.relative_to(path)))
            if not found:
                raise LmcliError(f"folder {path} contains no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif glob.has_magic(pattern):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
            found = [p for p in found if p.is_file()]
            if not found:
                raise LmcliError(f"no files match {pattern}")
            files.extend(found)
        else:
            raise LmcliError(f"no such file or folder: {pattern}")
    return files


def _looks_binary(head: bytes) -> bool:
    return b"\x00" in head


def _read_file(path: Path, stats: TextStats) -> Iterator[str]:
    """Yield a file's text in ~1 MiB chunks ending at line breaks; invalid UTF-8 is replaced."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(8192)
            if _looks_binary(head):
                print(f"warning: skipping {path}: looks like a binary file", file=sys.stderr)
                stats.skipped_binary += 1
                return
            stats.documents += 1
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            pending = head
            while True:
                block = f.read(CHUNK_BYTES)
                data = pending + block
                if block:
                    cut = data.rfind(b"\n") + 1 or len(data)
                    data, pending = data[:cut], data[cut:]
                else:
                    pending = b""
                stats.bytes += len(data)
                text = decoder.decode(data, final=not block)
                if "\ufffd" in text:  # count replacements, not U+FFFD that was in the file
                    stats.replaced += text.count("\ufffd") - data.count(b"\xef\xbf\xbd")
                if text:
                    yield text
                if not block:
                    return
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise LmcliError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


class Corpus:
    """A re-iterable source of documents; each document is yielded as chunks of text."""

    def __init__(self, identity: dict[str, Any], description: str) -> None:
        self.identity = identity
        self.description = description
        self.stats = TextStats()

    def documents(self) -> Iterator[Iterator[str]]:
        raise NotImplementedError

    def is_empty(self) -> bool:
        """True when the corpus holds no text but white space (reads only up to the first text)."""
        return not any(chunk.strip() for chunk in self.texts())

    def texts(self) -> Iterator[str]:
        """All text chunks in order (e.g. to train a tokenizer)."""
        for doc in self.documents():
            yield from doc

    @property
    def key(self) -> str:
        blob = json.dumps(self.identity, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class FileCorpus(Corpus):
    """Local files, folders, globs and .gz files."""

    def __init__(self, patterns: tuple[str, ...] | list[str]) -> None:
        self.files = resolve_paths(patterns)
        ident = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in self.files]
        names = ", ".join(str(p) for p in self.files[:3]) + (" ..." if len(self.files) > 3 else "")
        super().__init__({"files": ident}, f"{len(self.files)} file(s): {names}")

    def documents(self) -> Iterator[Iterator[str]]:
        self.stats = TextStats()
        for path in self.files:
            yield _read_file(path, self.stats)


class BuiltinCorpus(Corpus):
    """CPython's documentation topics (``pydoc_data.topics``): offline on any machine."""

    def __init__(self) -> None:
        super().__init__(
            {"builtin": "pydoc_data.topics", "python": sys.version.split()[0]},
            "built-in corpus: Python documentation topics (pydoc_data)",
        )

    def documents(self) -> Iterator[Iterator[str]]:
        try:
            from pydoc_data.topics import topics
        except ImportError:
            raise LmcliError("this Python has no pydoc_data; give a corpus path") from None
        self.stats = TextStats()
        for name in sorted(topics):
            text = topics[name]
            self.stats.documents += 1
            self.stats.bytes += len(text.encode())
            yield iter([text])


class DatasetCorpus(Corpus):
    """A Hugging Face ``datasets`` corpus: ``NAME[:CONFIG]``, or a local data file/folder."""

    def __init__(self, spec: str, split: str, text_column: str) -> None:
        self.dataset = load_hf_dataset(spec, split)
        if text_column not in self.dataset.column_names:
            cols = ", ".join(self.dataset.column_names)
            raise LmcliError(f"dataset {spec} has no column {text_column!r} (columns: {cols})")
        self.column = text_column
        fingerprint = getattr(self.dataset, "_fingerprint", None)
        super().__init__(
            {"dataset": spec, "split": split, "column": text_column, "fingerprint": fingerprint},
            f"dataset {spec} [{split}] column {text_column!r} ({len(self.dataset)} rows)",
        )

    def documents(self) -> Iterator[Iterator[str]]:
        self.stats = TextStats()
        for batch in self.dataset.iter(batch_size=1000):
            for text in batch[self.column]:
                if not isinstance(text, str) or not text:
                    continue
                self.stats.documents += 1
                self.stats.bytes += len(text.encode())
                yield iter([text])


def load_hf_dataset(spec: str, split: str) -> Any:
    """``datasets.load_dataset`` for a hub name (``NAME[:CONFIG]``) or a local file/folder."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(spec).expanduser()
    try:
        if local.is_file():
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
                local.suffix, "text"
            )
            return datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
        if local.is_dir():
            return datasets.load_dataset(str(local), split=split)
        name, _, config = spec.partition(":")
        return datasets.load_dataset(name, config or None, split=split)
    except LmcliError:
        raise
    except Exception as exc:  # datasets raises many types: hub unreachable, bad split, ...
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise LmcliError(f"cannot load dataset {spec} (split {split}): {reason}") from None


def open_corpus(paths: tuple[str, ...], dataset: str | None, split: str, text_column: str) -> Corpus:
    """The corpus a user asked for: paths, a dataset, or the built-in default."""
    if paths and dataset:
        raise LmcliError("give corpus paths or --dataset, not both")
    if dataset:
        return DatasetCorpus(dataset, split, text_column)
    if paths:
        return FileCorpus(paths)
    return BuiltinCorpus()


# ----------------------------------------------------------------------------- token cache


@dataclass
class TokenFile:
    """A tokenized corpus on disk: ``n_tokens`` ids of ``dtype`` in ``path``."""

    path: Path
    n_tokens: int
    dtype: str
    meta: dict[str, Any]
    cached: bool = False  # True when reused from an earlier run

    def array(self) -> np.ndarray:
        if self.n_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))


def default_cache_dir() -> Path:
    env = os.environ.get("LMCLI_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lmcli"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenize_corpus(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path, *, progress: bool = True
) -> TokenFile:
    """Tokenize ``corpus`` into ``cache_dir`` (each document followed by ``<eos>``), or reuse it.

    Streams in chunks, so memory stays flat however large the corpus; the file appears under
    its final name only when complete.
    """
    key = hashlib.sha256(f"{CACHE_VERSION}:{corpus.key}:{tokenizer.fingerprint}".encode()).hexdigest()[:20]
    cache_dir = Path(cache_dir)
    bin_path, meta_path = cache_dir / f"tokens-{key}.bin", cache_dir / f"tokens-{key}.json"
    if meta_path.exists() and bin_path.exists():
        meta = json.loads(meta_path.read_text())
        size = np.dtype(meta["dtype"]).itemsize * meta["n_tokens"]
        if bin_path.stat().st_size == size:
            return TokenFile(bin_path, meta["n_tokens"], meta["dtype"], meta, cached=True)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmcliError(f"cannot create cache folder {cache_dir}: {exc.strerror}") from None
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = cache_dir / f".tokens-{key}.{os.getpid()}.tmp"
    n_tokens = n_unknown = 0
    bar = _progress_bar(progress, corpus)
    try:
        with open(tmp, "wb") as out:
            for doc in corpus.documents():
                for chunk in _batched(doc, CHUNK_BYTES):
                    ids_list = tokenizer.encode_batch(chunk)
                    for ids in ids_list:
                        arr = np.asarray(ids, dtype=dtype)
                        out.write(arr.tobytes())
                        n_tokens += arr.size
                        if tokenizer.unk_id is not None:
                            n_unknown += int((arr == tokenizer.unk_id).sum())
                    if bar is not None:
                        bar.update(sum(len(t.encode()) for t in chunk))
                out.write(np.asarray([tokenizer.eos_id], dtype=dtype).tobytes())
                n_tokens += 1
        stats = corpus.stats
        meta = {
            "n_tokens": n_tokens,
            "dtype": dtype,
            "documents": stats.documents,
            "bytes": stats.bytes,
            "replaced": stats.replaced,
            "skipped_binary": stats.skipped_binary,
            "unknown": n_unknown,
            "corpus": corpus.description,
            "tokenizer": tokenizer.fingerprint,
        }
        if stats.documents == 0 or n_tokens <= stats.documents:
            raise LmcliError(f"corpus is empty: {corpus.description}")
        os.replace(tmp, bin_path)
        tmp_meta = meta_path.with_suffix(".json.tmp")
        tmp_meta.write_text(json.dumps(meta, indent=2))
        os.replace(tmp_meta, meta_path)
    except OSError as exc:
        raise LmcliError(f"cannot write token cache in {cache_dir}: {exc.strerror}") from None
    finally:
        if bar is not None:
            bar.close()
        tmp.unlink(missing_ok=True)
    return TokenFile(bin_path, n_tokens, dtype, meta)


def _batched(chunks: Iterator[str], max_bytes: int) -> Iterator[list[str]]:
    """Group a document's chunks, split further at line breaks, into ~max_bytes batches."""
    batch: list[str] = []
    size = 0
    for chunk in chunks:
        # encode_batch parallelizes over items, and is fastest on pieces of a few KiB
        for piece in _split_lines(chunk, PIECE_CHARS):
            batch.append(piece)
            size += len(piece)
            if size >= max_bytes:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _split_lines(text: str, target: int) -> Iterator[str]:
    """``text`` in pieces of at most ``target`` characters, cut after a line break, or else
    before a space (where a byte-level BPE word starts), or else anywhere."""
    start = 0
    while len(text) - start > target:
        cut = text.rfind("\n", start, start + target) + 1
        if cut <= start:
            cut = text.rfind(" ", start + 1, start + target)
        if cut <= start:
            cut = start + target
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def _progress_bar(enabled: bool, corpus: Corpus) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    total = None
    if isinstance(corpus, FileCorpus):
        total = sum(p.stat().st_size for p in corpus.files if p.suffix != ".gz") or None
    # disable=None: no bar when stderr is not a terminal (logs, CI, pipes)
    return tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr, leave=False, disable=None
    )


# ----------------------------------------------------------------------------- batches

IGNORE = -100  # a target id the loss skips (F.cross_entropy's default ignore_index)


@dataclass
class Batch:
    """Inputs (B, T), targets (B, T) with IGNORE where no loss applies, optional prefix lengths (B,)."""

    x: torch.Tensor
    y: torch.Tensor
    prefix_len: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if device.type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return Batch(move(self.x), move(self.y), move(self.prefix_len))

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


class WindowSampler:
    """Training batches drawn without replacement from the corpus's windows.

    Each epoch visits every window index ``k`` once, in a seeded random order; window ``k`` starts
    at ``k*T + jitter``, a seeded random shift in ``[0, T)`` that is new every epoch, so a token
    meets many positions and contexts across epochs. The stream of windows, epoch after epoch,
    is cut into global batches; rank ``r`` of ``W`` takes its own slice of each, so ranks never
    share data. The position is one number, ``cursor`` (windows consumed), so resuming, even at
    another world size, continues the same stream.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, seed: int) -> None:
        n = len(tokens)
        require_window(n, block_size)
        self.tokens = tokens
        self.block_size = block_size
        self.seed = seed
        self.n_windows = (n - 1) // block_size
        self.last_start = n - 1 - block_size  # the latest start with a full window and target
        self._epoch: tuple[int, np.ndarray] | None = None

    def _starts(self, epoch: int) -> np.ndarray:
        """Window starts of an epoch, in the order they are drawn."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(self.n_windows)
            jitter = rng.integers(0, self.block_size, size=self.n_windows)
            starts = np.minimum(order * self.block_size + jitter, self.last_start)
            self._epoch = (epoch, starts)
        return self._epoch[1]

    def window_starts(self, first: int, count: int) -> list[int]:
        """Token offsets of windows ``first .. first+count-1`` of the global stream."""
        starts = []
        for g in range(first, first + count):
            epoch, index = divmod(g, self.n_windows)
            starts.append(int(self._starts(epoch)[index]))
        return starts

    def batch(self, first: int, count: int) -> Batch:
        """Inputs and targets, each (count, T), for windows ``first .. first+count-1``."""
        return Batch(*windows_to_batch(self.tokens, self.window_starts(first, count), self.block_size))

    def epoch_of(self, cursor: int) -> float:
        return cursor / self.n_windows


def windows_to_batch(
    tokens: np.ndarray, starts: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s : s + block_size + 1], dtype=np.int64) for s in starts])
    data = torch.from_numpy(rows)  # (B, T+1)
    return data[:, :-1], data[:, 1:]


def eval_windows(n_tokens: int, block_size: int, max_windows: int) -> list[int]:
    """Evenly spaced, non-overlapping validation windows (deterministic, the same every time)."""
    n_windows = (n_tokens - 1) // block_size
    if n_windows <= max_windows:
        return [k * block_size for k in range(n_windows)]
    picks = np.linspace(0, n_windows - 1, max_windows).round().astype(int)
    return [int(k) * block_size for k in picks]
