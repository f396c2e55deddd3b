"""Tokenizing a corpus into a folder of token shards on every core: ``lmcli tokenize`` and
``lmcli train``'s token cache.

The corpus is read once, in order, as pieces of text (``split_pieces``: a few KiB, cut at line
breaks) and document ends. Pieces are grouped into jobs of about ``JOB_CHARS`` characters,
encoded by worker processes (``tokenizers``' batch encode in each) and written, in order, into
shards of about ``shard_tokens`` tokens (``lmcli.data.token_shards``). A small corpus is encoded
in this process, where starting workers would cost more than it saves; once ``POOL_AFTER``
characters have been read, workers take over. At most two jobs per worker are in flight, so
memory stays flat however large the corpus. Grouping never changes an id: each piece is encoded
on its own, wherever it is encoded.

A folder is written under a lock (``.lock``). A writer killed mid-way leaves its finished shards;
the next writer of the same plan keeps them (each checked, each continuing the one before) and
tokenizes the rest, reading past what they hold.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmcli.data.corpus import Corpus, FileCorpus
from lmcli.data.token_shards import (
    EOS_DTYPE,
    INDEX,
    PLAN,
    TokenFolder,
    file_check,
    folder_problem,
    plan_of,
    read_cache_json,
    same_plan,
    shard_name,
    shard_problem,
    token_dtype,
)
from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write, file_mode, remove_stale_temps, temp_file
from lmcli.text.tokenizer import CONFIG, PIECE_CHARS, Tokenizer, split_pieces

JOB_CHARS = 1 << 20  # characters of text per job: one batch encode
POOL_AFTER = 1 << 24  # characters read before workers start (16 MiB: ~10 s of one core)
SHARD_TOKENS = 100_000_000  # tokens per shard (about: a shard ends with the job that fills it)

Item = str | None  # a piece of text, or None: the end of a document (its <eos>)


@dataclass
class Encoded:
    """A job's ids, where its documents' ``<eos>`` are, and what it held."""

    ids: np.ndarray
    eos: np.ndarray  # positions in ids
    unknown: int  # ids that are <unk>
    bytes: int  # UTF-8 bytes of the job's text


def corpus_items(corpus: Corpus) -> Iterator[Item]:
    """The corpus as pieces of text, each document followed by None (its ``<eos>``)."""
    for document in corpus.documents():
        for chunk in document:
            yield from split_pieces(chunk, PIECE_CHARS)
        yield None


def group_jobs(items: Iterator[Item], job_chars: int, position: int) -> Iterator[tuple[int, list[Item]]]:
    """Items in jobs of about ``job_chars`` characters (a document's end stays with the text
    before it), each with the number of items read through it (counting from ``position``)."""
    job: list[Item] = []
    size = 0
    for item in items:
        if item is not None and size >= job_chars:
            yield position, job
            job, size = [], 0
        job.append(item)
        position += 1
        size += len(item) if item is not None else 0
    if job:
        yield position, job


def encode_items(tokenizer: Tokenizer, items: list[Item], dtype: str) -> Encoded:
    """One job's ids: each piece encoded on its own, an ``<eos>`` where a document ends."""
    texts = [t for t in items if t is not None]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    flat: list[int] = []
    eos: list[int] = []
    for item in items:
        if item is None:
            eos.append(len(flat))
            flat.append(tokenizer.eos_id)
        else:
            flat.extend(next(encoded))
    ids = np.array(flat, dtype=dtype)
    unknown = int((ids == tokenizer.unk_id).sum()) if tokenizer.unk_id is not None else 0
    size = sum(len(t.encode("utf-8", errors="replace")) for t in texts)
    return Encoded(ids, np.array(eos, dtype=EOS_DTYPE), unknown, size)


_WORKER: dict[str, Any] = {}  # a worker process's tokenizer and dtype (set by _start_worker)


def _start_worker(tokenizer_json: str, specials: dict[str, str], dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    from tokenizers import Tokenizer as HFTokenizer

    _WORKER.update(tokenizer=Tokenizer(HFTokenizer.from_str(tokenizer_json), specials), dtype=dtype)


def _encode_in_worker(items: list[Item]) -> Encoded:
    return encode_items(_WORKER["tokenizer"], items, _WORKER["dtype"])


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Encoders:
    """Jobs encoded in order: in this process at first, by ``workers`` processes once
    ``pool_after`` characters have been read (never, with one worker)."""

    def __init__(self, tokenizer: Tokenizer, dtype: str, workers: int, pool_after: int | None = None) -> None:
        self.tokenizer, self.dtype = tokenizer, dtype
        self.workers = workers or default_workers()
        self.pool_after = POOL_AFTER if pool_after is None else pool_after
        self.read = 0

    def _pool(self) -> ProcessPoolExecutor:
        # spawn: a worker starts clean, not a copy of a process that holds threads (torch, rayon)
        return ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(self.tokenizer.to_json(), self.tokenizer.specials, self.dtype),
        )

    def encode(self, jobs: Iterable[tuple[int, list[Item]]]) -> Iterator[tuple[int, Encoded]]:
        """(position, encoded job) of every job, in order."""
        pool: ProcessPoolExecutor | None = None
        pending: deque[tuple[int, Future[Encoded]]] = deque()
        try:
            for position, items in jobs:
                if pool is None and self.workers > 1 and self.read >= self.pool_after:
                    pool = self._pool()
                self.read += sum(len(t) for t in items if t is not None)
                if pool is None:
                    yield position, encode_items(self.tokenizer, items, self.dtype)
                    continue
                pending.append((position, pool.submit(_encode_in_worker, items)))
                while len(pending) > 2 * self.workers:
                    yield _result(pending.popleft())
            while pending:
                yield _result(pending.popleft())
        finally:
            if pool is not None:
                pool.shutdown(wait=not pending, cancel_futures=True)


def _result(job: tuple[int, Future[Encoded]]) -> tuple[int, Encoded]:
    try:
        return job[0], job[1].result()
    except BrokenProcessPool as exc:
        raise LmcliError(f"tokenizing failed: a worker process died ({exc})") from None


class ShardSink:
    """Encoded jobs in, shards out: each shard committed whole (its ids, its documents' ends,
    then its record) once it holds ``shard_tokens`` tokens, and the last one at ``finish``."""

    def __init__(self, folder: Path, dtype: str, first: int, start: int, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.index, self.start = first, start  # the next shard's number and its first item
        self.records: list[dict[str, Any]] = []
        self.tmp: Path | None = None
        self._open()

    def _open(self) -> None:
        self.tmp = temp_file(self.folder / f"{shard_name(self.index)}.bin")
        os.chmod(self.tmp, file_mode())  # as open() would make it, not mkstemp's 0o600
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed by commit or abort
        self.n, self.unknown = 0, 0
        self.eos: list[np.ndarray] = []

    def add(self, encoded: Encoded, position: int) -> None:
        self.file.write(memoryview(encoded.ids).cast("B"))
        self.eos.append(encoded.eos + self.n)
        self.n += len(encoded.ids)
        self.unknown += encoded.unknown
        if self.n >= self.shard_tokens:
            self.commit(position)
            self._open()

    def commit(self, position: int) -> None:
        """The shard written so far, under its names; its record last."""
        assert self.tmp is not None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        name = shard_name(self.index)
        base = self.folder / name
        os.replace(self.tmp, f"{base}.bin")
        self.tmp = None
        eos = np.concatenate(self.eos) if self.eos else np.zeros(0, dtype=EOS_DTYPE)
        atomic_write(Path(f"{base}.docs"), eos.astype(EOS_DTYPE).tobytes())
        record = {
            "name": name,
            "n_tokens": self.n,
            "n_docs": len(eos),
            "start": self.start,  # items of the corpus before this shard, and through it
            "position": position,
            "unknown": self.unknown,
            "check": {"bin": file_check(Path(f"{base}.bin")), "docs": file_check(Path(f"{base}.docs"))},
        }
        atomic_write(Path(f"{base}.json"), json_text(record))
        self.records.append(record)
        self.index, self.start = self.index + 1, position

    def finish(self, position: int) -> list[dict[str, Any]]:
        if self.n:
            self.commit(position)
        else:
            self.abort()
        return self.records

    def abort(self) -> None:
        if self.tmp is not None:
            self.file.close()
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


def json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


LOCK = ".lock"


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` (its ``.lock``) while it is written; another writer waits.
    The lock file is removed as the lock is let go (while still held: a writer that waited for
    it finds it gone and locks a new one), so a finished folder holds no ``.lock``."""
    import fcntl

    path = folder / LOCK
    for _ in range(100):
        folder.mkdir(parents=True, exist_ok=True)  # a failed writer before us may have removed it
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another lmcli writing {folder} ...", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, path):
            break
        os.close(fd)  # its writer finished and removed it: lock the next one
    else:
        raise LmcliError(f"cannot lock {folder}: its {LOCK} keeps changing")
    try:
        yield
    finally:
        if _same_file(fd, path):
            path.unlink(missing_ok=True)
        os.close(fd)


def kept_shards(folder: Path, dtype: str) -> list[dict[str, Any]]:
    """The shards a killed writer finished: the longest run from the first whose records and
    files check and each continues the one before."""
    records: list[dict[str, Any]] = []
    for i in itertools.count():
        record = read_cache_json(folder / f"{shard_name(i)}.json")
        start = records[-1]["position"] if records else 0
        if (
            record is None
            or record.get("name") != shard_name(i)
            or record.get("start") != start
            or type(record.get("position")) is not int
            or shard_problem(folder, record, dtype) is not None
        ):
            return records
        records.append(record)
    return records


def _clear_from(folder: Path, first: int) -> None:
    """Remove the shard files numbered ``first`` and on (and the index): they are redone."""
    (folder / INDEX).unlink(missing_ok=True)
    for path in folder.glob("shard-*"):
        number = path.name.split(".")[0].removeprefix("shard-")
        if number.isdigit() and int(number) >= first:
            path.unlink(missing_ok=True)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def write_token_folder(
    corpus: Corpus,
    tokenizer: Tokenizer,
    folder: Path,
    *,
    workers: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    what: str = "token folder",
    info: Callable[[str], None] = _stderr,
) -> TokenFolder:
    """Tokenize ``corpus`` into ``folder`` (or reuse it, or finish what a killed writer began).

    ``info`` hears (of the ``what``: token folder, token cache) that a finished folder is
    damaged and rebuilt, or how many shards of an interrupted one are kept."""
    plan = plan_of(corpus.key, corpus.description, tokenizer)
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with locked(folder):
            remove_stale_temps(folder)
            index, reason = folder_problem(folder, plan)
            if index is not None:
                return TokenFolder(folder, index, cached=True)
            if (folder / INDEX).exists():
                info(f"warning: {what} {folder} is damaged ({reason}): rebuilding it")
            try:
                index = _write(corpus, tokenizer, folder, plan, workers, shard_tokens, progress, what, info)
            except Exception:  # a bad row, a full disk: nothing of this run may block the next
                _forget_failed(folder, plan)
                raise
    except OSError as exc:
        raise LmcliError(f"cannot write tokens in {folder}: {exc.strerror or exc}") from None
    finally:
        if made and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # made by this failed run, and left empty
    return TokenFolder(folder, index)


def _write(
    corpus: Corpus,
    tokenizer: Tokenizer,
    folder: Path,
    plan: dict[str, Any],
    workers: int,
    shard_tokens: int,
    progress: bool,
    what: str,
    info: Callable[[str], None],
) -> dict[str, Any]:
    """The folder's shards (those of an interrupted writer of the same plan kept) and its index."""
    planned = same_plan(read_cache_json(folder / PLAN), plan)
    kept = kept_shards(folder, plan["dtype"]) if planned else []
    _clear_from(folder, len(kept))
    if kept:
        info(f"{what} {folder}: resuming, {len(kept)} finished shard(s) kept")
    atomic_write(folder / PLAN, json_text(plan))
    save_tokenizer(tokenizer, folder)
    records = kept + _tokenize(corpus, tokenizer, folder, kept, workers, shard_tokens, progress)
    index = _index(corpus, plan, records)
    atomic_write(folder / INDEX, json_text(index))
    return index


def _forget_failed(folder: Path, plan: dict[str, Any]) -> None:
    """After a failure (not a kill or Ctrl-C, which leave the folder to resume): with no finished
    shard, remove what this run wrote (its plan and tokenizer); else mark its plan ``failed``, so
    that a retry of another (a fixed) corpus may start over, while one of the same corpus keeps
    the shards. On a disk too full for the mark, the plan goes: the shards are then redone."""
    if (folder / INDEX).exists():
        return
    if kept_shards(folder, plan["dtype"]):
        with contextlib.suppress(OSError, LmcliError):
            atomic_write(folder / PLAN, json_text({**plan, "failed": True}))
            return
    for name in (PLAN, "tokenizer.json", CONFIG):
        with contextlib.suppress(OSError):
            (folder / name).unlink(missing_ok=True)


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """``tokenizer.json`` (and the roles it names, ``tokenizer_config.json``), each written whole."""
    atomic_write(folder / "tokenizer.json", tokenizer.to_json())
    if tokenizer.config():
        atomic_write(folder / CONFIG, json.dumps(tokenizer.config(), indent=2, ensure_ascii=False) + "\n")


def _tokenize(
    corpus: Corpus,
    tokenizer: Tokenizer,
    folder: Path,
    kept: list[dict[str, Any]],
    workers: int,
    shard_tokens: int,
    progress: bool,
) -> list[dict[str, Any]]:
    """The shards after ``kept``: the corpus read from its start, the items ``kept`` holds skipped."""
    dtype = token_dtype(tokenizer.vocab_size)
    start = kept[-1]["position"] if kept else 0
    bar = _progress_bar(progress, corpus)
    items = corpus_items(corpus)
    for item in itertools.islice(items, start):  # read past what the kept shards hold
        if bar is not None and item is not None:
            bar.update(len(item.encode("utf-8", errors="replace")))
    sink = ShardSink(folder, dtype, len(kept), start, shard_tokens)
    position = start
    try:
        jobs = group_jobs(items, max(1, min(JOB_CHARS, shard_tokens)), start)
        for position, encoded in Encoders(tokenizer, dtype, workers).encode(jobs):
            sink.add(encoded, position)
            if bar is not None:
                bar.update(encoded.bytes)
        return sink.finish(position)
    finally:
        sink.abort()
        if bar is not None:
            bar.close()


def _index(corpus: Corpus, plan: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished folder's ``index.json``: the plan, what reading found, every shard's record."""
    stats = corpus.stats
    n_tokens = sum(r["n_tokens"] for r in records)
    if stats.documents == 0 or n_tokens <= stats.documents:
        raise LmcliError(f"corpus is empty: {corpus.description}")
    return {
        **plan,
        "n_tokens": n_tokens,
        "documents": stats.documents,
        "bytes": stats.bytes,
        "replaced": stats.replaced,
        "skipped_binary": stats.skipped_binary,
        "unknown": sum(r["unknown"] for r in records),
        "shards": records,
    }


def _progress_bar(enabled: bool, corpus: Corpus) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    total = corpus.plain_bytes if isinstance(corpus, FileCorpus) else None
    # disable=None: no bar when stderr is not a terminal (logs, CI, pipes)
    return tqdm(
        total=total or None,
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        file=sys.stderr,
        leave=False,
        disable=None,
    )
