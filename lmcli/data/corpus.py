"""Text sources: files, folders (recursive), globs, ``.gz`` and ``.zst`` files, JSONL and parquet
files (a text column, a document per row), a Hugging Face ``datasets`` corpus read in streaming
mode, or the built-in default (CPython's own documentation text, ``pydoc_data.topics``).

A ``Corpus`` yields documents as chunks of text ending at line breaks, so memory stays flat
however large a file is; invalid UTF-8 is replaced and counted, binary files are skipped.
``read_lines`` reads the line-aligned files of prompts, inputs and references.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from lmcli.data.readers import READ_ERRORS, is_table, open_binary, open_text, read_error, table_texts
from lmcli.errors import LmcliError

CHUNK_BYTES = 1 << 20  # read and tokenize about 1 MiB at a time


@dataclass
class TextStats:
    """What reading a corpus found: sizes, and invalid UTF-8 replaced by U+FFFD."""

    documents: int = 0
    bytes: int = 0
    replaced: int = 0  # invalid UTF-8 sequences replaced
    skipped_binary: int = 0  # files skipped because they look binary


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
        elif path.exists():  # a file; a device or a FIFO is refused when it is opened
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
    try:
        with open_binary(path) as f:
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
    except READ_ERRORS as exc:
        raise LmcliError(read_error(path, exc)) from None


class Identified:
    """A data source known by its ``identity`` (what its content is: paths, sizes and times of
    files, a dataset's fingerprint), whose hash keys caches, and by a ``description`` for people."""

    def __init__(self, identity: dict[str, Any], description: str) -> None:
        self.identity = identity
        self.description = description

    @property
    def key(self) -> str:
        blob = json.dumps(self.identity, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class Corpus(Identified):
    """A re-iterable source of documents; each document is yielded as chunks of text."""

    def __init__(self, identity: dict[str, Any], description: str) -> None:
        super().__init__(identity, description)
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


def _read_table(path: Path, column: str, stats: TextStats) -> Iterator[Iterator[str]]:
    """A JSONL or parquet file's documents: the ``column`` of each row (empty ones skipped)."""
    try:
        for text, replaced in table_texts(path, column):
            stats.replaced += replaced
            if text:
                stats.documents += 1
                stats.bytes += len(text.encode())
                yield iter([text])
    except READ_ERRORS as exc:
        raise LmcliError(read_error(path, exc)) from None


def file_identity(files: list[Path]) -> list[tuple[str, int, int]]:
    """What names a set of files' contents cheaply: each path, size and modification time."""
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


class FileCorpus(Corpus):
    """Local files, folders, globs, .gz and .zst files; JSONL and parquet files as rows of the
    ``text_column``, each row a document."""

    def __init__(self, patterns: tuple[str, ...] | list[str], text_column: str = "text") -> None:
        self.files = resolve_paths(patterns)
        self.column = text_column
        identity: dict[str, Any] = {"files": file_identity(self.files)}
        if any(is_table(p) for p in self.files):
            identity["column"] = text_column
        names = ", ".join(str(p) for p in self.files[:3]) + (" ..." if len(self.files) > 3 else "")
        super().__init__(identity, f"{len(self.files)} file(s): {names}")

    def documents(self) -> Iterator[Iterator[str]]:
        self.stats = TextStats()
        for path in self.files:
            if is_table(path):
                yield from _read_table(path, self.column, self.stats)
            else:
                yield _read_file(path, self.stats)

    @property
    def plain_bytes(self) -> int | None:
        """The bytes of text to read, when every file is uncompressed text (else None)."""
        if any(is_table(p) or p.name.endswith((".gz", ".zst")) for p in self.files):
            return None
        return sum(p.stat().st_size for p in self.files)


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
    """A Hugging Face ``datasets`` corpus, ``NAME[:CONFIG]`` or a local data file/folder, read in
    streaming mode: rows arrive as they are read (or downloaded), nothing is converted or held
    first, so a corpus of any size starts at once in flat memory."""

    def __init__(self, spec: str, split: str, text_column: str) -> None:
        self.spec, self.split = spec, split
        self.dataset = load_hf_dataset(spec, split, streaming=True)
        columns = self.dataset.column_names
        if columns is None:  # a streamed dataset may learn its columns from its first row
            first = next(iter(self._rows(self.dataset.take(1))), None)
            columns = list(first) if first is not None else [text_column]
        if text_column not in columns:
            raise LmcliError(f"dataset {spec} has no column {text_column!r} (columns: {', '.join(columns)})")
        self.column = text_column
        local = Path(spec).expanduser()
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        identity = {"dataset": spec, "split": split, "column": text_column, "streaming": True}
        if local.exists():  # a local dataset changes with its files; a hub one is named by its spec
            identity["files"] = file_identity(files)
        super().__init__(identity, f"dataset {spec} [{split}] column {text_column!r} (streamed)")

    def _rows(self, rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """``rows`` of the dataset, a failure while reading (a network error, a bad file) one line."""
        try:
            yield from rows
        except LmcliError:
            raise
        except Exception as exc:  # datasets raises many types
            where = f"dataset {self.spec} (split {self.split})"
            raise LmcliError(f"cannot read {where}: {_reason(exc)}") from None

    def documents(self) -> Iterator[Iterator[str]]:
        self.stats = TextStats()
        for row in self._rows(self.dataset):
            text = row.get(self.column)
            if not isinstance(text, str) or not text:
                continue
            self.stats.documents += 1
            self.stats.bytes += len(text.encode())
            yield iter([text])


def _reason(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


def load_hf_dataset(spec: str, split: str, *, streaming: bool = False) -> Any:
    """``datasets.load_dataset`` for a hub name (``NAME[:CONFIG]``) or a local file/folder;
    ``streaming``: an ``IterableDataset`` that reads rows as they are asked for."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(spec).expanduser()
    try:
        if local.is_file():
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(
                local.suffix, "text"
            )
            files = {split: str(local)}
            return datasets.load_dataset(builder, data_files=files, split=split, streaming=streaming)
        if local.is_dir():
            return datasets.load_dataset(str(local), split=split, streaming=streaming)
        name, _, config = spec.partition(":")
        return datasets.load_dataset(name, config or None, split=split, streaming=streaming)
    except LmcliError:
        raise
    except Exception as exc:  # datasets raises many types: hub unreachable, bad split, ...
        raise LmcliError(f"cannot load dataset {spec} (split {split}): {_reason(exc)}") from None


def open_corpus(paths: tuple[str, ...], dataset: str | None, split: str, text_column: str) -> Corpus:
    """The corpus a user asked for: paths, a dataset, or the built-in default."""
    if paths and dataset:
        raise LmcliError("give corpus paths or --dataset, not both")
    if dataset:
        return DatasetCorpus(dataset, split, text_column)
    if paths:
        return FileCorpus(paths, text_column)
    return BuiltinCorpus()


def read_lines(path: str | Path, keep: int | None = None, end: bool = True) -> list[str]:
    """The lines of a text file (``.gz`` allowed), split at ``\\n`` only, so line i stays line i.
    With ``keep``, a longer line is read as its last (``end``) or first ``keep`` characters:
    the rest is never held, however long the line (a 100 MB prompt line)."""
    try:
        with open_text(Path(path)) as f:
            if keep is None:
                return [line.rstrip("\r\n") for line in f]
            return list(_bounded_lines(f, keep, end))
    except READ_ERRORS as exc:  # e.g. a corrupt or truncated .gz, or a folder
        raise LmcliError(read_error(path, exc)) from None


def _bounded_lines(f: Any, keep: int, end: bool) -> Iterator[str]:
    """The lines of the text file ``f``, each cut to its last (``end``) or first ``keep``
    characters, read 1 MiB at a time: at most ``keep`` + 1 MiB of a line is held (and 64 KiB
    more, for the ``\\r`` that may end it)."""
    hold = keep + (1 << 16)

    def cut(text: str, n: int) -> str:
        return text[-n:] if end else text[:n]

    line = ""
    while chunk := f.read(1 << 20):
        *done, rest = chunk.split("\n")
        for piece in done:
            yield cut((line + piece).rstrip("\r"), keep)
            line = ""
        line = cut(line + rest, hold)
    if line:
        yield cut(line.rstrip("\r"), keep)


T = TypeVar("T")


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of ``size`` (the last one shorter), read lazily."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
