"""The token cache: each corpus tokenized once, in pieces, into a flat file of ids.

The file (uint16, or uint32 for large vocabularies) lives under the cache folder, keyed by a
hash of the corpus and the tokenizer; a second run memory-maps it instead of tokenizing again.
Tokenizing streams, so memory stays flat however large the corpus.
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
from lmcli.tokenizer import PIECE_CHARS, Tokenizer, split_pieces

CACHE_VERSION = 2  # 2: 4 KiB pieces cut at a line break, else before a space


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
