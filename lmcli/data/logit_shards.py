"""A teacher's next-token distributions beside a folder of token shards: what ``lmcli tokenize
CORPUS --teacher MODEL --top-k K`` writes and ``lmcli train --task distill`` reads instead of
running the teacher. Two kinds (``--logits``, the record's ``logits``; a record without it is
of top-K logits): ``top``, each position's K most likely tokens and the mass left,

    shard-00000.top-ids    (n_tokens, K) the ids of the K most likely next tokens at each
                           position of the shard: uint16 (uint32 for vocabularies over 65,536)
    shard-00000.top-logp   (n_tokens, K) float16: their log-probabilities, taken after the softmax
                           over the whole vocabulary (at the temperature recorded)
    shard-00000.top-rest   (n_tokens,) float16: the log of the mass left to the other tokens
    shard-00000.top.json   the shard's record, written last: its size and a checksum of each file
    teacher.json           written when every shard is: the teacher's identity (its weights'
                           sha256 and tokenizer), K, the temperature, the context, the identity
                           of the tokens, every shard's record

or ``sampled``, K tokens drawn (with replacement, as drawn) from the teacher's distribution at
each position and their log-probabilities:

    shard-00000.drawn-ids  (n_tokens, K) the ids drawn, uint16 (uint32 over 65,536 tokens)
    shard-00000.drawn-logp (n_tokens, K) float16: the teacher's log-probability of each
    shard-00000.drawn.json the shard's record

Row ``i`` of a shard is the teacher's distribution of the token after position ``i``, read in
the shard's chunks of ``context`` tokens from the chunk's start (position ``c * context``): a
training window that starts where a chunk does sees exactly the context the teacher saw
(``grid``). A position costs ``4 K + 2`` bytes top-K (``6 K + 2`` with uint32 ids), ``4 K``
sampled (``6 K``).

Files appear whole (a temporary name, then a rename); a shard counts once its record is there,
so a killed writer leaves finished shards and the next writer keeps them. Every file's size and
the checksum of its ends (``token_shards.file_check``) are checked whenever the folder is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lmcli.data.stream import TokenStream
from lmcli.data.token_shards import TokenFolder, damaged, file_check, read_cache_json, token_dtype
from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write, file_mode, temp_file

FORMAT = "lmcli-teacher-logits"
RECORD = "teacher.json"
LOGP_DTYPE = np.dtype("<f2")
ID_CHECK_ROWS = 1 << 18  # rows of ids checked against the vocabulary at a time


@dataclass(frozen=True)
class Layout:
    """How a kind of logits is stored: its version (sampled logits are 2: an lmcli that reads
    only top-K ones refuses them), each shard's files by extension (ids, log-probs, and the
    rest for top-K) and its record's extension."""

    version: int
    parts: tuple[str, ...]
    record: str


LAYOUTS = {
    "top": Layout(1, ("top-ids", "top-logp", "top-rest"), "top.json"),
    "sampled": Layout(2, ("drawn-ids", "drawn-logp"), "drawn.json"),
}


def kind_of(record: dict[str, Any]) -> str:
    """The kind of the logits a record describes (``top`` when it does not say: written before
    sampled logits were)."""
    return str(record.get("logits", "top"))


def label(record: dict[str, Any]) -> str:
    """What a position of the logits a record describes holds, in words: ``top-64`` or ``64
    draws``."""
    k = record.get("top_k")
    return f"top-{k}" if kind_of(record) == "top" else f"{k} draws"


def tokens_identity(folder: TokenFolder) -> str:
    """What the logits are of: a hash of the token folder's tokenizer and every shard's record
    (its size and checksums): logits of other tokens, or of the same text tokenized anew with
    another tokenizer, have another."""
    shards = [[r["name"], r["n_tokens"], r.get("check")] for r in folder.index["shards"]]
    text = json.dumps({"tokenizer": folder.index.get("tokenizer"), "shards": shards}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def bytes_per_token(k: int, vocab_size: int, kind: str = "top") -> int:
    """What a position costs on disk: K ids and K float16 log-probs, and (top-K) the float16
    remainder."""
    rest = LOGP_DTYPE.itemsize if kind == "top" else 0
    return k * (np.dtype(token_dtype(vocab_size)).itemsize + LOGP_DTYPE.itemsize) + rest


@dataclass
class LogitPiece:
    """One shard's logits, memory-mapped: ids (n, K), log-probs (n, K), remainders (n,) (None:
    sampled logits)."""

    ids: np.ndarray
    logp: np.ndarray
    rest: np.ndarray | None


@dataclass
class LogitFolder:
    """A token folder's finished teacher logits (``teacher.json`` read, every shard checked)."""

    path: Path
    record: dict[str, Any]

    @property
    def top_k(self) -> int:
        """K: the tokens stored a position (the most likely, or the draws)."""
        return int(self.record["top_k"])

    @property
    def kind(self) -> str:
        return kind_of(self.record)

    @property
    def label(self) -> str:
        return label(self.record)

    @property
    def context(self) -> int:
        return int(self.record["context"])

    @property
    def temperature(self) -> float:
        return float(self.record["temperature"])

    @property
    def teacher(self) -> dict[str, Any]:
        return self.record["teacher"]

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.top_k, int(self.record["vocab_size"]), self.kind)

    def pieces(self) -> list[LogitPiece]:
        """Every shard's logits, memory-mapped."""
        k, dtype, out = self.top_k, self.record["dtype"], []
        parts = LAYOUTS[self.kind].parts
        for shard in self.record["shards"]:
            base, n = self.path / shard["name"], shard["n_tokens"]
            ids = np.memmap(f"{base}.{parts[0]}", dtype=dtype, mode="r", shape=(n, k))
            logp = np.memmap(f"{base}.{parts[1]}", dtype=LOGP_DTYPE, mode="r", shape=(n, k))
            rest = None
            if len(parts) > 2:
                rest = np.memmap(f"{base}.{parts[2]}", dtype=LOGP_DTYPE, mode="r", shape=(n,))
            out.append(LogitPiece(ids, logp, rest))
        return out

    def check_ids(self, vocab_size: int) -> None:
        """One line when a shard holds an id outside the vocabulary (a crafted or damaged file
        would otherwise index past the student's logits)."""
        for shard, piece in zip(self.record["shards"], self.pieces(), strict=True):
            for start in range(0, len(piece.ids), ID_CHECK_ROWS):
                top = int(piece.ids[start : start + ID_CHECK_ROWS].max())
                if top >= vocab_size:
                    raise LmcliError(
                        f"teacher logits in {self.path}: {shard['name']} holds token id {top}, outside "
                        f"the vocabulary of {vocab_size}: compute them again (lmcli tokenize --teacher)"
                    )


def gather(
    pieces: list[LogitPiece], stream: TokenStream, starts: list[int], length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The logits of the windows of ``stream`` (whose pieces are the shards, or their first
    parts) at ``starts``, ``length`` positions each: ids (B, T, K) int64, log-probs (B, T, K)
    and remainders (B, T) (None: sampled logits), float32."""
    ids, logp, rest = [], [], []
    for start in starts:
        index, offset = stream.locate(start)
        piece = pieces[index]
        ids.append(np.asarray(piece.ids[offset : offset + length], dtype=np.int64))
        logp.append(np.asarray(piece.logp[offset : offset + length], dtype=np.float32))
        if piece.rest is not None:
            rest.append(np.asarray(piece.rest[offset : offset + length], dtype=np.float32))
    return np.stack(ids), np.stack(logp), np.stack(rest) if rest else None


def open_logit_folder(folder: TokenFolder) -> LogitFolder | None:
    """The teacher logits beside a token folder's shards (None when it has none), checked: one
    line naming what is wrong (unfinished, damaged, of other tokens)."""
    path = folder.path / RECORD
    if not os.path.lexists(path):
        if any(any(folder.path.glob(f"*.{layout.record}")) for layout in LAYOUTS.values()):
            raise LmcliError(
                f"the teacher logits in {folder.path} are unfinished: run the same lmcli tokenize "
                "--teacher again to finish them"
            )
        return None
    record = read_cache_json(path)
    if record is None or record.get("format") != FORMAT or not isinstance(record.get("shards"), list):
        raise LmcliError(
            f"{path} does not describe teacher logits: compute them again (lmcli tokenize --teacher)"
        )
    layout = LAYOUTS.get(kind_of(record))
    if layout is None or record.get("version") != layout.version:
        known = ", ".join(f"{kind} logits of version {layout.version}" for kind, layout in LAYOUTS.items())
        raise LmcliError(
            f"{path}: {kind_of(record)} teacher logits of version {record.get('version')}, this lmcli "
            f"reads {known}"
        )
    if record.get("tokens") != tokens_identity(folder):
        raise LmcliError(
            f"the teacher logits in {folder.path} are of other tokens than its shards (tokenized again, or "
            "copied from another folder): compute them again (lmcli tokenize --teacher)"
        )
    names = [r["name"] for r in folder.index["shards"]]
    if [s.get("name") for s in record["shards"]] != names:
        raise LmcliError(f"{path} does not list the folder's shards: compute the logits again")
    logits = LogitFolder(folder.path, record)
    for shard, tokens in zip(record["shards"], folder.index["shards"], strict=True):
        n = tokens["n_tokens"]
        reason = shard_problem(folder.path, shard, logits.top_k, record["dtype"], n, logits.kind)
        if reason is not None:
            raise LmcliError(
                f"the teacher logits in {folder.path} are damaged ({reason}): compute them again"
            )
    return logits


def shard_problem(
    folder: Path, shard: dict[str, Any], k: int, dtype: str, n_tokens: int, kind: str
) -> str | None:
    """Why a shard's logit files (of the ``kind``'s layout) do not match its record (sizes and
    checksums), or None."""
    if shard.get("n_tokens") != n_tokens or not isinstance(shard.get("check"), dict):
        return f"{shard.get('name')}: its record does not describe its shard"
    itemsizes = (k * np.dtype(dtype).itemsize, k * LOGP_DTYPE.itemsize, LOGP_DTYPE.itemsize)
    for part, itemsize in zip(LAYOUTS[kind].parts, itemsizes, strict=False):  # ids, log-probs[, rest]
        size = n_tokens * itemsize
        check = shard["check"].get(part)
        file = folder / f"{shard['name']}.{part}"
        if not isinstance(check, dict) or check.get("size") != size:
            return f"{file.name}: its record does not describe it"
        reason = damaged(file, {"check": check})
        if reason is not None:
            return f"{file.name}: {reason}"
    return None


class LogitSink:
    """One shard's logits written in order, rows at a time (``add``), then committed whole
    (``commit``: its files renamed into place, its record last)."""

    def __init__(self, folder: Path, name: str, n_tokens: int, plan: str, kind: str) -> None:
        self.folder, self.name, self.n_tokens, self.rows, self.plan = folder, name, n_tokens, 0, plan
        self.layout = LAYOUTS[kind]
        self.temps: dict[str, Path] = {}
        self.files: dict[str, BinaryIO] = {}
        for part in self.layout.parts:
            self.temps[part] = temp_file(folder / f"{name}.{part}")
            os.chmod(self.temps[part], file_mode())
            self.files[part] = open(self.temps[part], "wb")  # noqa: SIM115 - closed by commit or abort

    def add(self, ids: np.ndarray, logp: np.ndarray, rest: np.ndarray | None, dtype: str) -> None:
        """The next rows: ids (n, K), log-probs (n, K), remainders (n,) (None: sampled logits)."""
        parts = self.layout.parts
        self.files[parts[0]].write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
        self.files[parts[1]].write(np.ascontiguousarray(logp, dtype=LOGP_DTYPE).tobytes())
        if rest is not None:
            self.files[parts[2]].write(np.ascontiguousarray(rest, dtype=LOGP_DTYPE).tobytes())
        self.rows += len(ids)

    def commit(self) -> dict[str, Any]:
        """The shard's files under their names, then its record; the record."""
        assert self.rows == self.n_tokens, f"{self.name}: {self.rows} rows for {self.n_tokens} tokens"
        check = {}
        for part in self.layout.parts:
            f = self.files.pop(part)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            final = self.folder / f"{self.name}.{part}"
            os.replace(self.temps.pop(part), final)
            check[part] = file_check(final)
        record = {"name": self.name, "n_tokens": self.n_tokens, "plan": self.plan, "check": check}
        atomic_write(self.folder / f"{self.name}.{self.layout.record}", json.dumps(record, indent=2) + "\n")
        return record

    def abort(self) -> None:
        for part in list(self.files):
            self.files.pop(part).close()
            self.temps.pop(part).unlink(missing_ok=True)


def plan_digest(plan: dict[str, Any]) -> str:
    """A short hash of what logits are (their plan, the teacher's path aside): a shard's record
    holds it, so a writer keeps only the shards of its own plan."""
    teacher = {k: v for k, v in plan.get("teacher", {}).items() if k != "path"}
    text = json.dumps({**plan, "teacher": teacher}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_shard(folder: Path, name: str, n_tokens: int, plan: dict[str, Any]) -> dict[str, Any] | None:
    """A shard's record that a killed writer of the same ``plan`` finished (its files checked),
    or None."""
    kind = kind_of(plan)
    record = read_cache_json(folder / f"{name}.{LAYOUTS[kind].record}")
    if record is None or record.get("name") != name or record.get("plan") != plan_digest(plan):
        return None
    problem = shard_problem(folder, record, plan["top_k"], plan["dtype"], n_tokens, kind)
    return record if problem is None else None


def write_record(folder: TokenFolder, plan: dict[str, Any], shards: list[dict[str, Any]]) -> LogitFolder:
    """``teacher.json``, once every shard's logits are written: the folder's logits are ready."""
    record = {**plan, "shards": shards}
    atomic_write(folder.path / RECORD, json.dumps(record, indent=2) + "\n")
    return LogitFolder(folder.path, record)
