"""The tokens of a corpus from its options: the token cache, the tokenizers trained on corpora,
and the folder ``lmcli tokenize`` writes.

Each corpus ``lmcli train`` reads is tokenized once into a folder of token shards
(``lmcli.data.token_shards``, the format ``lmcli tokenize`` writes too) under the cache folder,
keyed by a hash of the corpus and the tokenizer; a second run memory-maps it instead of
tokenizing again. A char or BPE tokenizer trained on a corpus is cached beside it.

Tokenizing streams on every core (``lmcli.data.tokenize``), so memory stays flat however large
the corpus. A cache is input too: every shard's size and a checksum of its ends are recorded
and checked, so a cache that was truncated, overwritten or zeroed is rebuilt, with a warning,
instead of training on garbage. Temporary files carry the writer's pid (``lmcli.safe_io``);
those of writers that died are removed at the next start, and the shards they finished kept.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lmcli.config.commands import TokenizeConfig
from lmcli.config.train import DataConfig
from lmcli.data.corpus import Corpus, open_corpus
from lmcli.data.token_shards import (
    INDEX,
    PLAN,
    TokenFolder,
    is_token_folder,
    plan_of,
    read_cache_json,
    same_plan,
)
from lmcli.data.tokenize import write_token_folder
from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write, remove_stale_temps
from lmcli.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lmcli.data.examples import ExampleSource

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


def tokenizer_for(data: DataConfig, corpus: Corpus | ExampleSource, cache_dir: Path) -> Tokenizer:
    """Load ``--tokenizer PATH``, or train char/byte/BPE on the corpus (trained ones are cached)."""
    kind, vocab_size = data.tokenizer, data.vocab_size
    if kind not in ("char", "byte", "bpe"):
        return Tokenizer.load(kind)
    if kind == "byte":
        return Tokenizer.train("byte", iter(()))
    size = vocab_size if kind == "bpe" else 0
    cached = cache_dir / f"tokenizer-{corpus.key}-{kind}-{size}.json"
    if cached.exists():
        try:
            return Tokenizer.load(cached)
        except LmcliError as exc:
            print(f"warning: {exc}: training it again", file=sys.stderr)
    tok = Tokenizer.train(kind, corpus.texts(), vocab_size)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(cached, tok.to_json())
    except OSError as exc:
        raise LmcliError(f"cannot write to cache folder {cache_dir}: {exc.strerror}") from None
    return tok


def tokenize_to(
    cfg: TokenizeConfig, *, progress: bool = True, tokenizer: Tokenizer | None = None
) -> TokenFolder:
    """``lmcli tokenize``: the corpus of ``cfg.data`` tokenized into the folder ``cfg.out`` (a
    finished one of the same corpus and tokenizer reused, an interrupted one finished); a folder
    that holds anything else is refused before any work. ``tokenizer``: the one to use (a
    teacher's) instead of ``--tokenizer``'s."""
    data, out = cfg.data, Path(cfg.out or "")
    for path in data.corpus:
        if is_token_folder(Path(path)):
            raise LmcliError(
                f"{path} is a folder of token shards already: train on it with lmcli train {path}"
            )
    if out.is_dir() and not is_token_folder(out) and any(not p.name.startswith(".") for p in out.iterdir()):
        raise LmcliError(f"{out} is not empty and holds no token shards: choose another --out")
    corpus = open_corpus(data.corpus, data.dataset, data.split, data.text_column)
    if corpus.is_empty():
        raise LmcliError(f"corpus is empty: {corpus.description}")
    if tokenizer is None:
        tokenizer = tokenizer_for(
            data, corpus, Path(data.cache_dir) if data.cache_dir else default_cache_dir()
        )
    plan = plan_of(corpus.key, corpus.description, tokenizer)
    for name in (INDEX, PLAN):
        there = read_cache_json(out / name)
        failed = name == PLAN and there is not None and there.get("failed") is True  # may start over
        if there is not None and not same_plan(there, plan) and not failed:
            raise LmcliError(
                f"{out} holds the tokens of another corpus or tokenizer ({there.get('corpus')}): "
                "choose another --out"
            )
    return write_token_folder(
        corpus, tokenizer, out, workers=cfg.workers, shard_tokens=cfg.shard_tokens, progress=progress
    )
