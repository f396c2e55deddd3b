"""The token cache: each corpus ``lmcli train`` reads, tokenized once into a folder of token
shards (``lmcli.data.token_shards``, the format ``lmcli tokenize`` writes) under the cache
folder, keyed by a hash of the corpus and the tokenizer; a second run memory-maps it instead of
tokenizing again.

Tokenizing streams on every core (``lmcli.data.tokenize``), so memory stays flat however large
the corpus. A cache is input too: every shard's size and a checksum of its ends are recorded
and checked, so a cache that was truncated, overwritten or zeroed is rebuilt, with a warning,
instead of training on garbage. Temporary files carry the writer's pid (``lmcli.safe_io``);
those of writers that died are removed at the next start, and the shards they finished kept.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from lmcli.data.corpus import Corpus
from lmcli.data.token_shards import TokenFolder
from lmcli.data.tokenize import write_token_folder
from lmcli.errors import LmcliError
from lmcli.safe_io import remove_stale_temps
from lmcli.tokenizer import Tokenizer

CACHE_VERSION = 3  # 2: 4 KiB pieces cut at a line break, else before a space; 3: a folder of shards


def default_cache_dir() -> Path:
    env = os.environ.get("LMCLI_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lmcli"


def tokenize_corpus(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path, *, progress: bool = True
) -> TokenFolder:
    """``corpus`` tokenized into ``cache_dir`` (each document followed by ``<eos>``), or reused.

    The folder is keyed by the corpus and the tokenizer; it counts as written only once its
    ``index.json`` is (a killed writer's finished shards are kept for the next)."""
    key = hashlib.sha256(f"{CACHE_VERSION}:{corpus.key}:{tokenizer.fingerprint}".encode()).hexdigest()[:20]
    cache_dir = Path(cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmcliError(f"cannot create cache folder {cache_dir}: {exc.strerror}") from None
    for folder in [cache_dir, *cache_dir.glob("tokens-*/")]:  # what writers that died left, anywhere
        remove_stale_temps(folder)
    folder = cache_dir / f"tokens-{key}"
    return write_token_folder(corpus, tokenizer, folder, progress=progress, what="token cache")
