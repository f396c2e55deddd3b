"""Instruction and chat data for ``--task sft``: rows in, checked conversations out.

A row is ``{"prompt": ..., "response": ...}`` (optionally ``"system"``) or ``{"messages": [{"role":
"system|user|assistant", "content": ...}, ...]}``: an optional system message, then user and
assistant turns alternating, from a user turn to an assistant turn, no reply empty. Rows come
from a JSONL file (one object a line), a JSON file (a list of objects), a parquet file or a
``datasets`` corpus. Each conversation is rendered with the tokenizer's chat template (or
lmcli's) by ``lmcli.text.chat_template.encode_conversation``, which marks the reply tokens the loss
reads.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcli.data.corpus import load_hf_dataset
from lmcli.data.examples import Encoded, Skipped, truncate
from lmcli.data.readers import READ_ERRORS, open_binary, read_error
from lmcli.errors import LmcliError
from lmcli.text.chat_template import (
    Message,
    Renderer,
    Template,
    check_messages,
    check_text,
    encode_conversation,
)
from lmcli.text.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")


def conversation(row: Any, where: str) -> list[Message]:
    """A row as checked messages, or a one-line error naming ``where`` (file:line or row N)."""
    if not isinstance(row, dict):
        raise LmcliError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        try:
            messages = check_messages(row["messages"])
        except LmcliError as exc:
            raise LmcliError(f"{where}: {exc}") from None
    elif "prompt" in row and "response" in row:
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["response"]},
        ]
        if row.get("system") is not None:
            messages.insert(0, {"role": "system", "content": row["system"]})
        for m in messages:
            if not isinstance(m["content"], str):
                raise LmcliError(f"{where}: {m['role']!r} must be text")
            check_text(m["content"], f"{where}: {m['role']!r}")
    else:
        raise LmcliError(
            f'{where}: expected "prompt" and "response", or "messages" (found: {", ".join(row) or "nothing"})'
        )
    check_turns(messages, where)
    return messages


def check_turns(messages: list[Message], where: str) -> None:
    """An optional system message, then user/assistant alternating, ending with a non-empty reply."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise LmcliError(f"{where}: message {i} has role {m['role']!r}: use system, user or assistant")
    if not turns:
        raise LmcliError(f"{where}: no user and assistant turns")
    offset = len(messages) - len(turns)
    for i, m in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise LmcliError(
                f"{where}: roles out of order: message {i + offset} is {m['role']!r}, expected {expected!r} "
                "(an optional system message, then user and assistant alternating)"
            )
        if expected == "assistant" and not m["content"].strip():
            raise LmcliError(f"{where}: message {i + offset} is an empty assistant turn")
    if turns[-1]["role"] != "assistant":
        raise LmcliError(f"{where}: the conversation ends with a user turn: nothing to learn from it")


def _file_id(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


class ConversationRows:
    """Conversations from a JSONL/JSON/parquet file or a ``datasets`` name (``split`` for those)."""

    def __init__(self, spec: str, split: str = "train") -> None:
        self.spec, self.split = spec, split
        path = Path(spec).expanduser()
        self.path = path if path.is_file() else None
        self.kind = "jsonl" if self.path is not None and path.suffix in (".jsonl", ".json") else "dataset"
        if self.path is None and path.suffix in (".jsonl", ".json", ".parquet"):
            raise LmcliError(f"no such file: {spec}")
        self.dataset = load_hf_dataset(spec, split) if self.kind == "dataset" else None
        if self.path is not None:
            identity: Any = ("file", _file_id(self.path))
            self.description = str(self.path)
        else:
            identity = ("dataset", spec, split, getattr(self.dataset, "_fingerprint", None))
            self.description = f"dataset {spec} [{split}]"
        self._key = hashlib.sha256(json.dumps(["sft", identity]).encode()).hexdigest()[:16]

    @property
    def key(self) -> str:
        return self._key

    def rows(self) -> Iterator[tuple[str, Any]]:
        """(where, row) for every row: ``file:line`` or ``file row N``."""
        if self.dataset is not None:
            for n, row in enumerate(self.dataset):
                yield f"{self.description} row {n}", row
            return
        assert self.path is not None
        text = read_text(self.path)
        rows = _json_list(text, self.path)
        if rows is not None:  # one JSON list of rows
            for n, row in enumerate(rows):
                yield f"{self.path} row {n}", row
            return
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                raise LmcliError(f"{self.path}:{number}: not a JSON object") from None
            yield f"{self.path}:{number}", row

    def conversations(self) -> Iterator[list[Message]]:
        for where, row in self.rows():
            yield conversation(row, where)

    def texts(self) -> Iterator[str]:
        """Every message and role name, for training a tokenizer."""
        yield " ".join(ROLES)
        for messages in self.conversations():
            yield from (m["content"] for m in messages)

    def encoded(self, tok: Tokenizer, max_len: int) -> Iterator[Encoded | Skipped]:
        """Each conversation rendered with the tokenizer's chat template (or lmcli's, through a
        bounded ``Renderer``), the loss on the replies; cut to ``max_len`` tokens ("beyond" when no
        reply starts within them)."""
        template = Template(tok.chat_template, tok.origin or "the tokenizer") if tok.chat_template else None
        with Renderer() as renderer:
            for messages in self.conversations():
                ids, scored = encode_conversation(messages, template, tok, renderer=renderer)
                yield truncate(ids, scored, max_len)


def _json_list(text: str, path: Path) -> list[Any] | None:
    """The rows of a file that is one JSON list; None for JSON lines (one row a line, the first
    of which may itself be a list: its line is then named as a row that is no object)."""
    if not text.lstrip().startswith("["):
        return None
    try:
        rows = json.loads(text)
    except (ValueError, RecursionError) as exc:
        first = text.lstrip().split("\n", 1)[0]
        try:
            json.loads(first)
        except (ValueError, RecursionError):
            raise LmcliError(f"{path}: not valid JSON: {str(exc)[:200]}") from None
        return None  # JSON lines, the first a list
    return rows if isinstance(rows, list) else [rows]


def read_text(path: Path) -> str:
    """A file's text (``.gz`` too); invalid UTF-8 is replaced by U+FFFD, with a warning."""
    try:
        with open_binary(path) as f:  # a device or a FIFO is one line
            data = f.read()
    except READ_ERRORS as exc:
        raise LmcliError(read_error(path, exc)) from None
    text = data.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - data.count(b"\xef\xbf\xbd")  # not U+FFFD that was in the file
    if replaced:
        print(
            f"warning: replaced {replaced} invalid UTF-8 sequence(s) in {path} with U+FFFD", file=sys.stderr
        )
    return text
