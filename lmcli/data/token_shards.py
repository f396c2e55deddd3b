"""The one tokenized-data format: a folder of token shards, written by ``lmcli tokenize`` and by
``lmcli train``'s token cache alike, memory-mapped by training.

    tokenizer.json       the tokenizer the ids are of (and tokenizer_config.json, if it names roles)
    plan.json            what is tokenized: corpus, tokenizer, dtype (an interrupted run resumes it)
    shard-00000.bin      token ids, uint16 (uint32 for vocabularies over 65,536); each document
                         is followed by <eos>
    shard-00000.docs     int64 positions, in the shard, of the <eos> that ends each document
    shard-00000.json     the shard's record, written last: its sizes, where in the corpus it
                         ends, and a checksum of each file
    index.json           written when every shard is: the shards and what reading found

Every file appears under its name whole (a temporary name, then a rename); a shard counts only
once its record is there, so a killed writer leaves finished shards and a folder that resumes.
A checksum of each file's first and last MiB and its size (``file_check``) is recorded and
checked whenever the folder is opened: a damaged cache is rebuilt, a damaged folder a user gave
is named in one line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmcli.data.stream import Piece, TokenStream
from lmcli.errors import LmcliError
from lmcli.safe_io import checked_file, read_input
from lmcli.text.tokenizer import Tokenizer

FORMAT = "lmcli-tokens"
VERSION = 3  # 2: one .bin per corpus; 3: shards with their documents' ends
INDEX, PLAN = "index.json", "plan.json"
CHECK_BYTES = 1 << 20  # file_check hashes this much at each end of a file
DTYPES = ("uint16", "uint32")
EOS_DTYPE = np.dtype("<i8")
ID_CHUNK = 1 << 24  # token ids checked against the vocabulary at a time


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


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
    """Why a file does not match the check (``meta["check"]``) recorded for it, or None."""
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
    """A small ``.json`` record as a dict, or None when it is missing, unreadable or not an object."""
    if path.is_symlink() or not path.exists():
        return None
    try:  # a device or a FIFO there is one line (read_input), never a hang
        data = json.loads(read_input(path, 1 << 26, "token folder record"))
    except (ValueError, RecursionError):  # not JSON, or nested too deeply: damaged
        return None
    return data if isinstance(data, dict) else None


def plan_of(corpus_key: str, description: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """What a folder holds the tokens of: a resumed or reused folder must have been planned alike."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "corpus_key": corpus_key,
        "corpus": description,
        "tokenizer": tokenizer.fingerprint,
        "dtype": token_dtype(tokenizer.vocab_size),
    }


def same_plan(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    keys = ("format", "version", "corpus_key", "tokenizer", "dtype")
    return a is not None and all(a.get(k) == b[k] for k in keys)


def shard_problem(folder: Path, record: Any, dtype: str) -> str | None:
    """Why a shard's record or files are not usable, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        return "a shard record is not an object with a name"
    name, n, n_docs = record["name"], record.get("n_tokens"), record.get("n_docs")
    if type(n) is not int or type(n_docs) is not int or n <= 0 or n_docs < 0:
        return f"{name}: its record does not describe a shard"
    checks = record.get("check")
    if not isinstance(checks, dict):
        return f"{name}: no checksum"
    sizes = {"bin": np.dtype(dtype).itemsize * n, "docs": EOS_DTYPE.itemsize * n_docs}
    for ext, size in sizes.items():
        path = folder / f"{name}.{ext}"
        if not path.exists():
            return f"missing {path.name}"
        check = checks.get(ext)
        if not isinstance(check, dict) or check.get("size") != size:
            return f"{path.name}: its record does not describe it"
        reason = damaged(path, {"check": check})
        if reason is not None:
            return f"{path.name}: {reason}"
    return None


def is_token_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of token shards (finished or not), not a folder of text."""
    for name in (INDEX, PLAN):
        data = read_cache_json(path / name) if path.is_dir() else None
        if data is not None and data.get("format") == FORMAT:
            return True
    return False


@dataclass
class TokenFolder:
    """A finished folder of token shards (its ``index.json`` read and every shard checked)."""

    path: Path
    index: dict[str, Any]
    cached: bool = False  # True when an earlier run's token cache was reused

    @property
    def dtype(self) -> str:
        return self.index["dtype"]

    @property
    def n_tokens(self) -> int:
        return sum(r["n_tokens"] for r in self.index["shards"])

    @property
    def meta(self) -> dict[str, Any]:
        """What reading the corpus found (documents, bytes, replaced, unknown, ...), as one dict."""
        return {k: v for k, v in self.index.items() if k != "shards"} | {"n_tokens": self.n_tokens}

    def stream(self) -> TokenStream:
        """Every shard memory-mapped, with its documents' ends."""
        pieces = []
        for record in self.index["shards"]:
            base = self.path / record["name"]
            tokens = np.memmap(f"{base}.bin", dtype=self.dtype, mode="r", shape=(record["n_tokens"],))
            eos = (
                np.memmap(f"{base}.docs", dtype=EOS_DTYPE, mode="r", shape=(record["n_docs"],))
                if record["n_docs"]
                else np.zeros(0, dtype=EOS_DTYPE)
            )
            pieces.append(Piece(tokens, eos))
        return TokenStream(pieces)

    def tokenizer(self) -> Tokenizer:
        """The folder's tokenizer, which must be the one its tokens were made with (the
        fingerprint ``index.json`` records): a replaced ``tokenizer.json`` is one line."""
        file = checked_file(self.path / "tokenizer.json")
        tok = Tokenizer.load(file)
        if self.index.get("tokenizer") != tok.fingerprint:
            raise LmcliError(
                f"token folder {self.path}: its tokenizer.json is not the tokenizer its tokens were "
                "made with (index.json records another): tokenize the corpus again"
            )
        if self.dtype != token_dtype(tok.vocab_size):
            raise LmcliError(
                f"token folder {self.path}: index.json says {self.dtype}, but a vocabulary of "
                f"{tok.vocab_size} tokens is stored as {token_dtype(tok.vocab_size)}"
            )
        return tok

    def check_ids(self, vocab_size: int) -> None:
        """One line when a shard holds an id outside the vocabulary (a damaged or crafted shard
        would otherwise index past the embedding): one pass over the shards, in chunks."""
        for record, piece in zip(self.index["shards"], self.stream().pieces, strict=True):
            for start in range(0, len(piece.tokens), ID_CHUNK):
                top = int(piece.tokens[start : start + ID_CHUNK].max())
                if top >= vocab_size:
                    raise LmcliError(
                        f"token folder {self.path}: {record['name']} holds token id {top}, outside "
                        f"the vocabulary of {vocab_size}: tokenize the corpus again"
                    )


def folder_problem(folder: Path, plan: dict[str, Any] | None = None) -> tuple[dict[str, Any] | None, str]:
    """A finished folder's index (None, and why, when it is missing, foreign or damaged)."""
    index = read_cache_json(folder / INDEX)
    if index is None:
        return None, f"its {INDEX} is missing or unreadable"
    if (
        index.get("format") != FORMAT
        or index.get("dtype") not in DTYPES
        or not isinstance(index.get("shards"), list)
    ):
        return None, f"its {INDEX} does not describe token shards"
    if plan is not None and not same_plan(index, plan):
        return None, "it holds the tokens of another corpus or tokenizer"
    for record in index["shards"]:
        reason = shard_problem(folder, record, index["dtype"])
        if reason is not None:
            return None, reason
    return index, ""


def open_token_folder(path: str | Path) -> TokenFolder:
    """A folder written by ``lmcli tokenize``, checked: one line naming what is wrong with it."""
    folder = Path(path)
    if not (folder / INDEX).exists():
        if (folder / PLAN).exists():
            shards = len(list(folder.glob("shard-*.json")))
            raise LmcliError(
                f"{folder} is unfinished: its tokenization stopped after {shards} shard(s); "
                "run the same lmcli tokenize again to finish it"
            )
        raise LmcliError(f"{folder} is not a folder of token shards (no {INDEX})")
    index, reason = folder_problem(folder)
    if index is None:
        if reason.startswith("missing "):
            name = reason.removeprefix("missing ")
            raise LmcliError(f"{folder} is missing shard {name} (listed in {INDEX})")
        raise LmcliError(f"token folder {folder} is damaged ({reason}): tokenize the corpus again")
    if not (folder / "tokenizer.json").is_file():
        raise LmcliError(f"token folder {folder} has no tokenizer.json")
    return TokenFolder(folder, index)
