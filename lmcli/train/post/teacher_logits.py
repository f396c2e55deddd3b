"""Offline teacher logits: ``lmcli tokenize CORPUS --teacher MODEL --top-k K -o DIR`` tokenizes
the corpus with the teacher's tokenizer into a folder of token shards, then runs the teacher
once over every shard, in chunks of ``--block-size`` tokens, and writes beside each shard the
top-K log-probabilities of every position, taken after the softmax over the whole vocabulary,
and the log of the mass left; with ``--logits sampled``, K tokens drawn from the teacher's
distribution at every position and their log-probabilities (``lmcli.data.logit_shards``: the
format). A distillation run on DIR reads them instead of running the teacher
(``distill.Distill``), as many students as like.

The work is resumable as tokenizing is: a shard's logits count once its record is written; a
writer killed mid-way leaves the shards it finished, and the same command keeps them. The draws
of a chunk are seeded by the shard's name and the chunk's place in it (``chunk_seed``): a
resumed writer draws what an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmcli.config.commands import TokenizeConfig
from lmcli.data.logit_shards import (
    FORMAT,
    LAYOUTS,
    RECORD,
    LogitFolder,
    LogitSink,
    kept_shard,
    kind_of,
    label,
    open_logit_folder,
    plan_digest,
    tokens_identity,
    write_record,
)
from lmcli.data.token_cache import tokenize_to
from lmcli.data.token_shards import TokenFolder, read_cache_json, token_dtype
from lmcli.data.tokenize import locked
from lmcli.device import pick_device, set_threads
from lmcli.errors import LmcliError
from lmcli.train.post.divergence import drawn, top_k
from lmcli.train.post.teacher import TeacherModel, named, same_teacher, source_tokenizer, teacher_source


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def tokenize_with_teacher(
    cfg: TokenizeConfig, *, progress: bool = True, info: Callable[[str], None] = _stderr
) -> tuple[TokenFolder, LogitFolder]:
    """``lmcli tokenize --teacher``: the corpus tokenized with the teacher's tokenizer, then its
    logits (``write_teacher_logits``); what the options cannot do is refused before any work."""
    assert cfg.distill.teacher is not None
    source = teacher_source(cfg.distill.teacher)
    tokenizer = source_tokenizer(source)
    context = source.config().block_size
    if cfg.logits == "top" and cfg.top_k > tokenizer.vocab_size:
        raise LmcliError(
            f"--top-k {cfg.top_k} is more than the teacher's vocabulary ({tokenizer.vocab_size} tokens)"
        )
    if cfg.block_size > context:
        raise LmcliError(
            f"--block-size {cfg.block_size} is longer than the teacher's context ({context} tokens)"
        )
    folder = tokenize_to(cfg, progress=progress, tokenizer=tokenizer)
    set_threads(cfg.threads)
    teacher = TeacherModel.open(source, pick_device(cfg.device))
    logits = write_teacher_logits(
        folder,
        teacher,
        k=cfg.top_k,
        kind=cfg.logits,
        context=cfg.block_size,
        temperature=cfg.distill.distill_temperature,
        batch=cfg.batch_size,
        progress=progress,
        info=info,
    )
    return folder, logits


def logits_plan(
    folder: TokenFolder, teacher: TeacherModel, k: int, context: int, temperature: float, kind: str = "top"
) -> dict[str, Any]:
    """What a folder's logits are: of which teacher and tokens, their kind, K, the chunks, the
    temperature."""
    return {
        "format": FORMAT,
        "version": LAYOUTS[kind].version,
        "teacher": teacher.ident,
        "logits": kind,
        "top_k": k,
        "context": context,
        "temperature": temperature,
        "vocab_size": teacher.vocab,
        "dtype": token_dtype(teacher.vocab),
        "tokens": tokens_identity(folder),
    }


def same_plan(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether two plans describe the same logits (the teacher wherever its files are; a plan
    that does not name its kind is of top-K logits)."""
    if a is None or not isinstance(a.get("teacher"), dict):
        return False
    a = {**a, "logits": kind_of(a)}
    keys = [key for key in b if key != "teacher"]
    return same_teacher(a["teacher"], b["teacher"]) and all(a.get(key) == b[key] for key in keys)


def write_teacher_logits(
    folder: TokenFolder,
    teacher: TeacherModel,
    *,
    k: int,
    context: int,
    kind: str = "top",
    temperature: float = 1.0,
    batch: int = 8,
    progress: bool = False,
    info: Callable[[str], None] = _stderr,
) -> LogitFolder:
    """Every shard's logits (those a killed writer of the same plan finished kept), then
    ``teacher.json``; finished logits of the same plan are reused, another plan's refused."""
    plan = logits_plan(folder, teacher, k, context, temperature, kind)
    with locked(folder.path):
        there = read_cache_json(folder.path / RECORD)
        if there is not None and not same_plan(there, plan):
            what = f"{label(there)}, block size {there.get('context')}"
            raise LmcliError(
                f"{folder.path} holds the logits of {named(there.get('teacher') or {})} ({what}, temperature "
                f"{there.get('temperature')}): choose another --out"
            )
        if there is not None:
            try:
                logits = open_logit_folder(folder)
                assert logits is not None
                return logits
            except LmcliError as exc:  # damaged: the shards that still check are kept
                info(f"warning: {exc}: computing them again")
                (folder.path / RECORD).unlink()
        records, resumed = [], 0
        bar = _bar(progress, folder.n_tokens)
        try:
            for shard, piece in zip(folder.index["shards"], folder.stream().pieces, strict=True):
                kept = kept_shard(folder.path, shard["name"], len(piece), plan)
                resumed += kept is not None
                records.append(kept or write_shard(folder, shard["name"], piece.tokens, teacher, plan, batch))
                if bar is not None:
                    bar.update(len(piece))
        finally:
            if bar is not None:
                bar.close()
        if resumed:
            info(f"teacher logits in {folder.path}: resuming, {resumed} finished shard(s) kept")
        return write_record(folder, plan, records)


def write_shard(
    folder: TokenFolder,
    name: str,
    tokens: np.ndarray,
    teacher: TeacherModel,
    plan: dict[str, Any],
    batch: int,
) -> dict[str, Any]:
    """One shard's logits, chunk after chunk, committed whole."""
    sink = LogitSink(folder.path, name, len(tokens), plan_digest(plan), plan["logits"])
    try:
        for ids, logp, rest in shard_logits(name, tokens, teacher, plan, batch):
            sink.add(ids, logp, rest, plan["dtype"])
        return sink.commit()
    except BaseException:
        sink.abort()
        raise


def chunk_seed(name: str, chunk: int) -> int:
    """The seed of the draws of a shard's ``chunk``-th chunk: a hash of the two, 63 bits."""
    digest = hashlib.sha256(f"{name}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def chunk_draws(name: str, logp: Tensor, first: int, width: int, k: int) -> tuple[Tensor, Tensor]:
    """``k`` draws of each position of consecutive chunks of ``width`` positions (log-probs
    (n * width, V)), the ``first``-th of the shard first, each chunk's from its own seed."""
    ids, values = [], []
    for j, rows in enumerate(logp.split(width)):
        generator = torch.Generator().manual_seed(chunk_seed(name, first + j))
        a, b = drawn(rows, k, generator)
        ids.append(a)
        values.append(b)
    return torch.cat(ids), torch.cat(values)


def shard_logits(
    name: str, tokens: np.ndarray, teacher: TeacherModel, plan: dict[str, Any], batch: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """The top-K (or the draws) of every position of the shard ``name``, in order: ``batch``
    chunks of ``context`` tokens at a time (the shard's last chunk may be shorter), each read
    from its own start."""
    context, k, temperature = plan["context"], plan["top_k"], plan["temperature"]
    device = next(teacher.model.parameters()).device
    n = len(tokens)
    for start in range(0, n, context * batch):
        stop = min(start + context * batch, n)
        whole = (stop - start) // context * context
        parts = [(start, start + whole, context)] if whole else []
        if start + whole < stop:
            parts.append((start + whole, stop, stop - start - whole))
        for lo, hi, width in parts:
            x = torch.from_numpy(np.asarray(tokens[lo:hi], dtype=np.int64)).view(-1, width).to(device)
            logp = teacher.logprobs(x, temperature).view(-1, teacher.vocab)  # (b, width, V) -> (N, V)
            if plan["logits"] == "sampled":
                ids, values = chunk_draws(name, logp, lo // context, width, k)
                yield ids.cpu().numpy(), values.cpu().numpy(), None
            else:
                ids, values, rest = top_k(logp, k)
                yield ids.cpu().numpy(), values.cpu().numpy(), rest.cpu().numpy()


def _bar(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc="teacher logits",
        file=sys.stderr,
        leave=False,
        disable=None,
    )
