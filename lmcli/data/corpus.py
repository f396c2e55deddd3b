"""Text sources: files, folders (recursive), globs, ``.gz`` files, a Hugging Face ``datasets``
corpus, or the built-in default (CPython's own documentation text, ``pydoc_data.topics``).

A ``Corpus`` yields documents as chunks of text ending at line breaks, so memory stays flat
however large a file is; invalid UTF-8 is replaced and counted, binary files are skipped.
``read_lines`` reads the line-aligned files of prompts, inputs and references.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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
    except READ_ERRORS as exc:
        raise LmcliError(read_error(path, exc)) from None


# what reading a damaged file raises: OSError (BadGzipFile too), a truncated gzip EOFError, a
# corrupt gzip body zlib.error
READ_ERRORS = (OSError, EOFError, zlib.error)


def read_error(path: Path | str, exc: BaseException) -> str:
    """One line naming ``path`` and what is wrong with it."""
    if isinstance(exc, zlib.error | EOFError | gzip.BadGzipFile):
        return f"cannot read {path}: corrupt or truncated gzip data ({exc})"
    return f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"


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


def open_text(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        return opener(path, "rt", encoding="utf-8", errors="replace", newline="\n")
    except OSError as exc:
        raise LmcliError(f"cannot read {path}: {exc.strerror}") from None


def read_lines(path: str | Path) -> list[str]:
    """The lines of a text file (``.gz`` allowed), split at ``\\n`` only, so line i stays line i."""
    try:
        with open_text(Path(path)) as f:
            return [line.rstrip("\r\n") for line in f]
    except READ_ERRORS as exc:  # e.g. a corrupt or truncated .gz, or a folder
        raise LmcliError(read_error(path, exc)) from None


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
