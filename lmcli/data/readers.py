"""Reading one file of a corpus: plain, ``.gz`` or ``.zst`` (Zstandard, the ``zstandard`` package),
as text or, for a table (JSONL, parquet), as the texts of one column, a row at a time.

Nothing here holds a whole file: compressed files are decompressed as they are read, JSONL is
read a line at a time and parquet a batch of rows at a time (``pyarrow``). Damaged input is one
line naming the file (``read_error``); a table row without the column names the row.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from lmcli.errors import LmcliError
from lmcli.safe_io import check_text, open_input, parse_json

BLOCK_BYTES = 1 << 20  # compressed bytes read at a time
TABLE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".parquet")


class CorruptData(ValueError):
    """A compressed file whose data cannot be decompressed (the message names the format)."""


# what reading a damaged file raises: OSError (BadGzipFile too), a truncated gzip EOFError, a
# corrupt gzip body zlib.error, a corrupt or truncated .zst CorruptData
READ_ERRORS = (OSError, EOFError, zlib.error, CorruptData)


def read_error(path: Path | str, exc: BaseException) -> str:
    """One line naming ``path`` and what is wrong with it."""
    if isinstance(exc, CorruptData):
        return f"cannot read {path}: {exc}"
    if isinstance(exc, zlib.error | EOFError | gzip.BadGzipFile):
        return f"cannot read {path}: corrupt or truncated gzip data ({exc})"
    return f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"


def _zstd_blocks(f: BinaryIO) -> Iterator[bytes]:
    """The decompressed bytes of a Zstandard stream of one or more frames; a frame cut short or
    a corrupt one raises ``CorruptData``."""
    try:
        import zstandard
    except ImportError:
        name = getattr(f, "name", "a .zst file")
        raise LmcliError(f"reading {name} needs the zstandard package: pip install 'lmcli[zstd]'") from None
    dctx = zstandard.ZstdDecompressor()
    frame, fed = dctx.decompressobj(), False
    try:
        while block := f.read(BLOCK_BYTES):
            while block:
                fed = True
                out = frame.decompress(block)
                if out:
                    yield out
                block = b""
                if frame.eof:  # the next frame starts in what this one left
                    block, frame, fed = frame.unused_data, dctx.decompressobj(), False
    except zstandard.ZstdError as exc:
        raise CorruptData(f"corrupt or truncated zstd data ({exc})") from None
    if fed and not frame.eof:
        raise CorruptData("corrupt or truncated zstd data (the last frame is cut short)")


class ZstdReader(io.RawIOBase):
    """A ``.zst`` file as a readable binary stream (wrap it in ``io.BufferedReader``)."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._file = f
        self._blocks = _zstd_blocks(f)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._left = memoryview(block)
        n = min(len(buffer), len(self._left))
        buffer[:n] = self._left[:n]
        self._left = self._left[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def open_binary(path: Path) -> BinaryIO:
    """``path`` opened for reading bytes, decompressed as read when it ends in .gz or .zst."""
    raw = open_input(path)  # a device or a FIFO is refused (one line), never read or waited on
    if path.name.endswith(".gz"):
        unpacked = gzip.GzipFile(fileobj=raw, mode="rb")
        unpacked.myfileobj = raw  # closed with it, as when gzip.open opens the file itself
        return unpacked  # type: ignore[return-value]
    if path.name.endswith(".zst"):
        return io.BufferedReader(ZstdReader(raw), BLOCK_BYTES)  # type: ignore[return-value]
    return raw


def open_text(path: Path) -> Any:
    """``path`` (.gz and .zst allowed) opened as UTF-8 text, invalid bytes replaced."""
    try:
        return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="replace", newline="\n")
    except OSError as exc:
        raise LmcliError(f"cannot read {path}: {exc.strerror}") from None


def is_table(path: Path) -> bool:
    """Whether a corpus file is read as rows of a text column (JSONL, parquet) rather than as text."""
    return path.name.endswith(TABLE_SUFFIXES)


def table_texts(path: Path, column: str) -> Iterator[tuple[str, int]]:
    """The ``column`` of each row of a JSONL or parquet file, with the invalid UTF-8 sequences
    replaced in it (rows whose value is null are skipped)."""
    if path.name.endswith(".parquet"):
        yield from ((text, 0) for text in _parquet_texts(path, column))
    else:
        yield from _jsonl_texts(path, column)


def _jsonl_texts(path: Path, column: str) -> Iterator[tuple[str, int]]:
    with open_binary(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            text = line.decode("utf-8", errors="replace")
            replaced = text.count("\ufffd") - line.count(b"\xef\xbf\xbd") if "\ufffd" in text else 0
            row = parse_json(text, f"{path}:{number}")
            if not isinstance(row, dict) or column not in row:
                found = ", ".join(list(row)[:8]) if isinstance(row, dict) else type(row).__name__
                raise LmcliError(f'{path}:{number}: expected a "{column}" field (found: {found})')
            value = row[column]
            if value is None:
                continue
            if not isinstance(value, str):
                raise LmcliError(f'{path}:{number}: "{column}" holds {type(value).__name__}, not text')
            yield check_text(value, f'{path}:{number}: "{column}"'), replaced


def _parquet_texts(path: Path, column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise LmcliError(f"cannot read {path}: {str(exc).splitlines()[0][:200]}") from None
    names = table.schema_arrow.names
    if column not in names:
        raise LmcliError(f"{path} has no column {column!r} (columns: {', '.join(names)})")
    try:
        for batch in table.iter_batches(batch_size=1024, columns=[column]):
            for value in batch.column(0).to_pylist():
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise LmcliError(f"{path}: column {column!r} holds {type(value).__name__}, not text")
                yield value
    except (OSError, pa.ArrowException) as exc:
        raise LmcliError(f"cannot read {path}: {str(exc).splitlines()[0][:200]}") from None
