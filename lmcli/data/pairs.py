"""Parallel text for decoder-only translation: pairs in, ``<bos> source <sep> target <eos>`` out.

Pairs come from two line-aligned files (``--source``/``--target``, ``.gz`` allowed), one TSV or
JSONL file, or a ``datasets`` corpus whose rows hold a translation. A pair is one case of a
supervised example (``lmcli.data.examples``): the source is the prompt, the target and its
``<eos>`` what the loss reads; caching, bucketing and batches are the examples'.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lmcli.data.corpus import Identified, batched, load_hf_dataset
from lmcli.data.examples import Encoded, Skipped
from lmcli.data.readers import READ_ERRORS, open_text, read_error
from lmcli.errors import LmcliError
from lmcli.safe_io import check_text, parse_json
from lmcli.text.tokenizer import Tokenizer


def _count_lines(path: Path) -> int:
    try:
        with open_text(path) as f:
            return sum(1 for _ in f)
    except READ_ERRORS as exc:
        raise LmcliError(read_error(path, exc)) from None


class PairCorpus(Identified):
    """A re-iterable source of (source, target) text pairs with a cache identity."""

    def pairs(self) -> Iterator[tuple[str, str]]:
        raise NotImplementedError

    def texts(self) -> Iterator[str]:
        """Both sides, for training a joint tokenizer."""
        for src, tgt in self.pairs():
            yield src
            yield tgt

    def encoded(self, tok: Tokenizer, max_len: int, chunk: int = 10_000) -> Iterator[Encoded | Skipped]:
        """Each pair as ``<bos> source <sep> target <eos>``, the loss on the target and ``<eos>``;
        a pair with an empty side is left out ("empty")."""
        for batch in batched(self.pairs(), chunk):
            kept = [(s, t) for s, t in batch if s.strip() and t.strip()]
            yield from ["empty"] * (len(batch) - len(kept))
            if not kept:
                continue
            srcs = tok.encode_batch([s for s, _ in kept])
            tgts = tok.encode_batch([t for _, t in kept])
            for s_ids, t_ids in zip(srcs, tgts, strict=True):
                ids, prefix, cut = encode_pair(s_ids, t_ids, tok, max_len)
                yield Encoded(ids, [False] * prefix + [True] * (len(ids) - prefix), prefix, cut)


def _file_id(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


class AlignedFiles(PairCorpus):
    """Two line-aligned files: line i of ``source`` translates to line i of ``target``."""

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = Path(source), Path(target)
        for p in (self.source, self.target):
            if not p.is_file():
                raise LmcliError(f"no such file: {p}")
        n_src, n_tgt = _count_lines(self.source), _count_lines(self.target)
        if n_src != n_tgt:
            raise LmcliError(
                f"source and target differ in length: {self.source} has {n_src} lines, "
                f"{self.target} has {n_tgt}"
            )
        super().__init__(
            {"source": _file_id(self.source), "target": _file_id(self.target)},
            f"{self.source} -> {self.target} ({n_src} lines)",
        )

    def pairs(self) -> Iterator[tuple[str, str]]:
        try:
            with open_text(self.source) as fs, open_text(self.target) as ft:
                for src, tgt in zip(fs, ft, strict=True):
                    yield src.rstrip("\n"), tgt.rstrip("\n")
        except READ_ERRORS as exc:
            raise LmcliError(read_error(f"{self.source} or {self.target}", exc)) from None


class TableFile(PairCorpus):
    """One TSV (``source<TAB>target``) or JSONL (``{"source": ..., "target": ...}``) file."""

    def __init__(self, path: str, source_column: str = "source", target_column: str = "target") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise LmcliError(f"no such file: {self.path}")
        self.columns = (source_column, target_column)
        self.jsonl = ".jsonl" in self.path.suffixes or ".json" in self.path.suffixes
        super().__init__({"table": _file_id(self.path), "columns": self.columns}, f"{self.path}")

    def pairs(self) -> Iterator[tuple[str, str]]:
        try:
            yield from self._rows()
        except READ_ERRORS as exc:
            raise LmcliError(read_error(self.path, exc)) from None

    def _rows(self) -> Iterator[tuple[str, str]]:
        with open_text(self.path) as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    yield "", ""
                    continue
                if self.jsonl:
                    row = parse_json(line, f"{self.path}:{number}")
                    try:
                        pair = str(row[self.columns[0]]), str(row[self.columns[1]])
                    except (KeyError, TypeError):
                        raise LmcliError(
                            f"{self.path}:{number}: expected a JSON object with "
                            f"{self.columns[0]!r} and {self.columns[1]!r}"
                        ) from None
                    where = f"{self.path}:{number}"
                    yield check_text(pair[0], where), check_text(pair[1], where)
                else:
                    parts = line.split("\t")
                    if len(parts) != 2:
                        raise LmcliError(f"{self.path}:{number}: expected source<TAB>target")
                    yield parts[0], parts[1]


class DatasetPairs(PairCorpus):
    """A ``datasets`` corpus: a ``translation`` column of {lang: text}, or two text columns."""

    def __init__(self, spec: str, split: str, source: str, target: str) -> None:
        self.dataset = load_hf_dataset(spec, split)
        cols = self.dataset.column_names
        if "translation" in cols:
            self.mode = "translation"
        elif source in cols and target in cols:
            self.mode = "columns"
        else:
            raise LmcliError(
                f"dataset {spec} has neither a 'translation' column nor columns {source!r} and "
                f"{target!r} (columns: {', '.join(cols)})"
            )
        self.source, self.target = source, target
        super().__init__(
            {
                "dataset": spec,
                "split": split,
                "fields": [source, target],
                "fingerprint": getattr(self.dataset, "_fingerprint", None),
            },
            f"dataset {spec} [{split}] ({len(self.dataset)} rows)",
        )

    def pairs(self) -> Iterator[tuple[str, str]]:
        for row in self.dataset:
            if self.mode == "translation":
                tr = row["translation"] or {}
                if self.source not in tr or self.target not in tr:
                    raise LmcliError(
                        f"translation rows need languages {self.source!r} and {self.target!r}, "
                        f"found {', '.join(tr)}: set --source-lang and --target-lang"
                    )
                yield tr[self.source] or "", tr[self.target] or ""
            else:
                yield row[self.source] or "", row[self.target] or ""


# ----------------------------------------------------------------------------- encoding


def encode_pair(src: list[int], tgt: list[int], tok: Tokenizer, max_len: int) -> tuple[list[int], int, bool]:
    """``<bos> src <sep> tgt <eos>`` in at most ``max_len`` tokens; (ids, prefix length, truncated).

    Too long: the source keeps at most half the room (more if the target is short) and the target
    the rest, without ``<eos>`` when it was cut, so the model never learns to stop early.
    """
    if tok.sep_id is None:
        raise LmcliError("the tokenizer has no <sep> token, which translation needs")
    room = max_len - 3  # <bos>, <sep>, <eos>
    truncated = len(src) + len(tgt) > room
    if truncated:
        n_src = min(len(src), max(room - len(tgt), room // 2))
        src = src[:n_src]
        tgt = tgt[: room + 1 - n_src]  # the <eos> slot goes to target text
        ids = [tok.bos_id, *src, tok.sep_id, *tgt]
    else:
        ids = [tok.bos_id, *src, tok.sep_id, *tgt, tok.eos_id]
    return ids, len(src) + 2, truncated
