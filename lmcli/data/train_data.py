"""A run's training and validation data, from its TrainConfig, as its task trains on them.

``load_train_data`` reads the corpus, trains or loads the tokenizer, tokenizes into the cache
(or reuses it; or opens a folder ``lmcli tokenize`` wrote) and splits off validation. It returns
``StreamData`` (language modelling: windows of one token stream, in shards) or ``ExampleData``
(a task with ``examples``, read by its reader in ``EXAMPLE_READERS``: translation pairs, SFT
conversations; whole examples whose loss reads the response only); both offer the two things
the training loop needs: a ``sampler`` and ``val_batches``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmcli.config.train import DataConfig, TrainConfig
from lmcli.data.conversations import ConversationRows
from lmcli.data.corpus import open_corpus
from lmcli.data.examples import ExampleSampler, ExampleSet, ExampleSource, collate, tokenize_examples
from lmcli.data.pairs import AlignedFiles, DatasetPairs, PairCorpus, TableFile
from lmcli.data.stream import TokenStream
from lmcli.data.token_cache import default_cache_dir, tokenize_corpus, tokenizer_for
from lmcli.data.token_shards import TokenFolder, is_token_folder, open_token_folder
from lmcli.data.windows import Batch, WindowSampler, eval_starts, require_window, windows_to_batch
from lmcli.errors import LmcliError
from lmcli.tasks import make_task
from lmcli.text.tokenizer import Tokenizer

Info = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


@dataclass
class StreamData:
    """Language modelling: train and validation ids of one token stream (in shards), read as
    windows anywhere or at documents' starts (``align``), with documents numbered for the
    attention mask (``documents``)."""

    tokenizer: Tokenizer
    train: TokenStream
    val: TokenStream
    block_size: int
    info: dict[str, Any] = field(default_factory=dict)
    align: bool = False
    documents: bool = False

    @property
    def train_tokens(self) -> int:
        return len(self.train)

    @property
    def val_tokens(self) -> int:
        return len(self.val)

    def sampler(self, batch_size: int, seed: int) -> WindowSampler:
        return WindowSampler(self.train, self.block_size, seed, align=self.align, documents=self.documents)

    def tokens_per_example(self) -> float:
        return float(self.block_size)

    def val_batches(self, batch_size: int, limit: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """A fixed set of validation windows (this rank's share), ``batch_size`` at a time."""
        context = min(self.block_size, max(len(p) for p in self.val.pieces) - 1)
        starts = eval_starts(self.val, context, limit, align=self.align)[rank::world]
        for i in range(0, len(starts), batch_size):
            part = starts[i : i + batch_size]
            yield windows_to_batch(self.val, part, context, documents=self.documents)


@dataclass
class ExampleData:
    """Translation or SFT: tokenized train and validation examples."""

    tokenizer: Tokenizer
    train: ExampleSet
    val: ExampleSet
    block_size: int
    info: dict[str, Any] = field(default_factory=dict)
    pad_multiple: int = 1  # batch widths are multiples of this (examples.pad_multiple)

    @property
    def train_tokens(self) -> int:
        return int(self.train.length.sum())

    @property
    def val_tokens(self) -> int:
        return int(self.val.length.sum())

    def sampler(self, batch_size: int, seed: int) -> ExampleSampler:
        return ExampleSampler(
            self.train, batch_size, seed, self.tokenizer.pad_id, self.block_size, self.pad_multiple
        )

    def tokens_per_example(self) -> float:
        return float(self.train.length.mean())

    def longest_example(self) -> int:
        """The widest batch's width: the longest training example, at most the context."""
        return min(self.block_size, int(self.train.length.max())) if len(self.train) else self.block_size

    def val_batches(self, batch_size: int, limit: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """The first ``limit`` validation examples (this rank's share), ``batch_size`` at a time."""
        indices = np.arange(min(limit, len(self.val)))[rank::world]
        for i in range(0, len(indices), batch_size):
            batch = indices[i : i + batch_size]
            yield collate(self.val, batch, self.tokenizer.pad_id, self.block_size, self.pad_multiple)


TrainData = StreamData | ExampleData


def cache_dir_of(cfg: TrainConfig) -> Path:
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()


def load_train_data(
    cfg: TrainConfig,
    *,
    block_size: int,
    tokenizer: Tokenizer | None = None,
    progress: bool = True,
    info: Info = _stderr,
) -> TrainData:
    """Read, tokenize (or reuse the cache) and split the corpus as ``cfg``'s task trains on it:
    windows of a token stream, or supervised examples (``tasks.Task.examples``)."""
    if make_task(cfg).examples is not None:
        return _prepare_examples(cfg, block_size, tokenizer, info)
    return _prepare_stream(cfg, block_size, tokenizer, progress, info)


def _prepare_stream(
    cfg: TrainConfig, block_size: int, tokenizer: Tokenizer | None, progress: bool, info: Info
) -> StreamData:
    data, cache_dir = cfg.data, cache_dir_of(cfg)
    train, tokenizer = _tokens(data.corpus, data.dataset, data, cache_dir, tokenizer, progress)
    meta = train.meta
    if meta.get("replaced"):
        info(f"warning: replaced {meta['replaced']} invalid UTF-8 sequence(s) in the corpus with U+FFFD")
    if meta.get("unknown"):
        info(f"warning: {meta['unknown']} character(s) unknown to the tokenizer became <unk>")
    ids = train.stream()
    if data.val:
        val, _ = _tokens((data.val,), None, data, cache_dir, tokenizer, progress)
        train_ids, val_ids = ids, val.stream()
    else:
        require_window(len(ids), block_size)
        n_val = int(len(ids) * data.val_fraction)
        train_ids, val_ids = ids.split(len(ids) - n_val)
    require_window(len(train_ids), block_size, "training split")
    if len(val_ids) < 2:
        raise LmcliError(
            f"validation split has {len(val_ids)} tokens: give a larger --val-fraction or a --val file"
        )
    facts = {**meta, "cached": train.cached}
    return StreamData(
        tokenizer, train_ids, val_ids, block_size, facts, data.align_documents, data.document_mask
    )


def _tokens(
    paths: tuple[str, ...],
    dataset: str | None,
    data: DataConfig,
    cache_dir: Path,
    tokenizer: Tokenizer | None,
    progress: bool,
) -> tuple[TokenFolder, Tokenizer]:
    """The tokens of a corpus and their tokenizer: a folder ``lmcli tokenize`` wrote (given as
    the corpus), or the token cache of the corpus, tokenized now if need be."""
    folders = [p for p in paths if is_token_folder(Path(p))]
    if folders and len(paths) > 1:
        raise LmcliError(f"{folders[0]} is a folder of token shards: give it as the only corpus")
    if folders:
        folder = open_token_folder(folders[0])
        own = folder.tokenizer()
        _check_folder_tokenizer(folder, own, tokenizer, data.tokenizer)
        folder.check_ids(own.vocab_size)
        folder.index["corpus"] = f"{folder.index.get('corpus')} (tokenized in {folder.path})"
        return folder, tokenizer or own
    corpus = open_corpus(paths, dataset, data.split, data.text_column)
    if corpus.is_empty():
        raise LmcliError(f"corpus is empty: {corpus.description}")
    if tokenizer is None:
        tokenizer = tokenizer_for(data, corpus, cache_dir)
    return tokenize_corpus(corpus, tokenizer, cache_dir, progress=progress), tokenizer


def _check_folder_tokenizer(
    folder: TokenFolder, own: Tokenizer, given: Tokenizer | None, option: str
) -> None:
    """A token folder trains with its own tokenizer: another one given (``--init-from``, a
    resumed run, ``--tokenizer`` other than the default) is refused."""
    if given is not None and given.fingerprint != own.fingerprint:
        raise LmcliError(
            f"{folder.path} was tokenized with another tokenizer than this run's (--init-from, --teacher or "
            "the resumed run): tokenize the corpus with that tokenizer"
        )
    if option in ("byte", "bpe") or (
        option != "char" and Tokenizer.load(option).fingerprint != own.fingerprint
    ):
        raise LmcliError(f"{folder.path} is tokenized already, with its own tokenizer: drop --tokenizer")


def open_examples(cfg: TrainConfig, *, validation: bool = False) -> ExampleSource | None:
    """The examples of ``cfg``'s task: parallel text or conversations (or the validation ones;
    None when there are none apart from the training data)."""
    kind = make_task(cfg).examples
    assert kind is not None, "a task that trains on a token stream has no examples"
    return EXAMPLE_READERS[kind](cfg, validation=validation)


def open_conversations(cfg: TrainConfig, *, validation: bool = False) -> ConversationRows | None:
    """The conversations of ``cfg`` (or its validation ones; None when it has none)."""
    data = cfg.data
    if validation:
        return ConversationRows(data.val, "train") if data.val else None
    if data.dataset:
        return ConversationRows(data.dataset, data.split)
    if len(data.corpus) == 1:
        return ConversationRows(data.corpus[0], data.split)
    raise LmcliError("sft needs one data file (JSONL, JSON or parquet) or --dataset")


def open_pairs(cfg: TrainConfig, *, validation: bool = False) -> PairCorpus | None:
    """The parallel corpus of ``cfg`` (or its validation corpus; None when it has none)."""
    data, pairs = cfg.data, cfg.translation
    fields = pairs.source_field, pairs.target_field
    if validation:
        if pairs.val_source:
            return AlignedFiles(pairs.val_source, pairs.val_target or "")
        if data.val:
            return TableFile(data.val, *fields)
        return None
    if pairs.source:
        return AlignedFiles(pairs.source, pairs.target or "")
    if data.dataset:
        return DatasetPairs(data.dataset, data.split, *fields)
    if len(data.corpus) == 1:
        return TableFile(data.corpus[0], *fields)
    raise LmcliError(
        "translation needs parallel text: --source FILE --target FILE, one TSV/JSONL file, or --dataset"
    )


# a task's ``examples`` -> the reader of its examples (tasks.py cannot import data/)
EXAMPLE_READERS: dict[str, Callable[..., ExampleSource | None]] = {
    "pairs": open_pairs,
    "conversations": open_conversations,
}


def _prepare_examples(
    cfg: TrainConfig, block_size: int, tokenizer: Tokenizer | None, info: Info
) -> ExampleData:
    cache_dir = cache_dir_of(cfg)
    source = open_examples(cfg)
    assert source is not None
    if tokenizer is None:
        tokenizer = tokenizer_for(cfg.data, source, cache_dir)
    examples = tokenize_examples(source, tokenizer, block_size + 1, cache_dir)
    task = make_task(cfg)
    what = task.example_noun
    val_source = open_examples(cfg, validation=True)
    if val_source is not None:
        val = tokenize_examples(val_source, tokenizer, block_size + 1, cache_dir)
        train = examples
        report_skipped(val, what, block_size, info, "validation ")
    else:
        n_val = int(len(examples) * cfg.data.val_fraction)
        if n_val < 1:
            raise LmcliError(f"no validation {what}: give {task.val_hint} or a larger --val-fraction")
        order = np.arange(len(examples))
        train, val = (
            examples.subset(order[: len(examples) - n_val]),
            examples.subset(order[len(examples) - n_val :]),
        )
    report_skipped(examples, what, block_size, info)
    stats = examples.stats
    facts = {
        "corpus": source.description,
        "cached": examples.cached,
        "examples": len(train),
        "empty": stats.empty,
        "truncated": stats.truncated,
        "beyond": stats.beyond,
    }
    return ExampleData(tokenizer, train, val, block_size, facts)


def report_skipped(examples: ExampleSet, what: str, block_size: int, info: Info, which: str = "") -> None:
    """One warning per kind of example left out or cut: never a silent drop."""
    stats = examples.stats
    if stats.empty:
        info(f"warning: skipped {stats.empty} {which}{what} with an empty side")
    context = f"the context ({block_size + 1} tokens)"
    if stats.beyond:
        info(f"warning: skipped {stats.beyond} {which}{what} with no reply within {context}")
    if stats.truncated:
        info(f"warning: truncated {stats.truncated} {which}{what} longer than {context}")
