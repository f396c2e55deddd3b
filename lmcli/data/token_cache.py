"""The token cache: each corpus tokenized once, in pieces, into a flat file of ids.

The file (uint16, or uint32 for large vocabularies) lives under the cache folder, keyed by a
hash of the corpus and the tokenizer; a second run memory-maps it instead of tokenizing again.
Tokenizing streams, so memory stays flat however large the corpus.

A cache is input too: its ``.json`` records the file's size and a sha256 of its first and last
MiB (``file_check``), so a cache that was truncated, overwritten or zeroed is rebuilt, with a
warning, instead of training on garbage; the whole file is not hashed, so that reuse stays
instant. Temporary files carry the writer's pid (``lmcli.safe_io``); those of writers that died
are removed at the next start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmcli.data.corpus import CHUNK_BYTES, Corpus, FileCorpus
from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write, remove_stale_temps, temp_file
from lmcli.tokenizer import PIECE_CHARS, Tokenizer, split_pieces

CACHE_VERSION = 2  # 2: 4 KiB pieces cut at a line break, else before a space
CHECK_BYTES = 1 << 20  # file_check hashes this much at each end of a cache file
DTYPES = ("uint16", "uint32")


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
    remove_stale_temps(cache_dir)
    cached = _reuse(bin_path, meta_path, tokenizer.vocab_size)
    if cached is not None:
        return cached
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmcliError(f"cannot create cache folder {cache_dir}: {exc.strerror}") from None
    dtype = token_dtype(tokenizer.vocab_size)
    n_tokens = n_unknown = 0
    bar = _progress_bar(progress, corpus)
    tmp: Path | None = None
    try:
        tmp = temp_file(bin_path)
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
        meta["check"] = file_check(tmp)
        os.replace(tmp, bin_path)
        atomic_write(meta_path, json.dumps(meta, indent=2))
    except OSError as exc:
        raise LmcliError(f"cannot write token cache in {cache_dir}: {exc.strerror}") from None
    finally:
        if bar is not None:
            bar.close()
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return TokenFile(bin_path, n_tokens, dtype, meta)


def file_check(path: Path) -> dict[str, Any]:
    """The size of ``path`` and a sha256 of its first and last ``CHECK_BYTES``."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(CHECK_BYTES))
        f.seek(max(size - CHECK_BYTES, 0))
        h.update(f.read(CHECK_BYTES))
    return {"size": size, "sha256_ends": h.hexdigest()}


def damaged(path: Path, meta: dict[str, Any]) -> str | None:
    """Why a cache file does not match the check its ``.json`` recorded, or None."""
    check = meta.get("check")
    if not isinstance(check, dict):
        return "no checksum (written by an older lmcli)"
    try:
        if not path.is_file() or path.is_symlink():
            return "not a regular file"
        if file_check(path) != check:
            return "size or checksum mismatch"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def read_cache_json(path: Path) -> dict[str, Any] | None:
    """A cache's ``.json`` as a dict, or None when it is missing, unreadable or not an object."""
    try:
        if path.is_symlink() or path.stat().st_size > 1 << 20:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _reuse(bin_path: Path, meta_path: Path, vocab_size: int) -> TokenFile | None:
    """The cached token file, or None (with a warning when one was there but is damaged)."""
    if not meta_path.exists() and not bin_path.exists():
        return None
    meta = read_cache_json(meta_path)
    if meta is None:
        reason = "its .json is missing or unreadable"
    else:
        n, dtype, check = meta.get("n_tokens"), meta.get("dtype"), meta.get("check")
        size = check.get("size") if isinstance(check, dict) else None
        if type(n) is not int or n < 0 or dtype != token_dtype(vocab_size):
            reason = "its .json does not describe a token file"
        elif size is not None and np.dtype(dtype).itemsize * n != size:
            reason = "its .json does not describe a token file"
        else:
            reason = damaged(bin_path, meta)
            if reason is None:
                return TokenFile(bin_path, n, dtype, meta, cached=True)
    print(f"warning: token cache {bin_path} is damaged ({reason}): rebuilding it", file=sys.stderr)
    return None


def _batched(chunks: Iterator[str], max_bytes: int) -> Iterator[list[str]]:
    """Group a document's chunks, split further at line breaks, into ~max_bytes batches."""
    batch: list[str] = []
    size = 0
    for chunk in chunks:
        # encode_batch parallelizes over items, and is fastest on pieces of a few KiB
        for piece in split_pieces(chunk, PIECE_CHARS):
            batch.append(piece)
            size += len(piece)
            if size >= max_bytes:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


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
