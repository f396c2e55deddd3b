"""Constrained decoding: a JSON schema, any JSON object, a regular expression or a Lark grammar
as a mask of the tokens each row may take next, applied before sampling.

The grammars are compiled by llguidance (the library behind the structured output of
llama.cpp's and vLLM's guidance backends): it builds the token masks lazily from a trie of the
vocabulary's bytes, so a schema compiles in about a millisecond, and a mask costs tens of
microseconds on a 32k BPE vocabulary (docs/structured-output.md has the measurement against
xgrammar and outlines-core). Every lmcli tokenizer works: the grammar sees each token's bytes
(``Tokenizer.token_bytes``), special tokens never match text, and the end-of-text token is
allowed exactly when the grammar is complete (when nothing else may follow, it is the only
token allowed).

``Grammars`` is one tokenizer's compiler: ``processor(constraint)`` gives a fresh
``GrammarMask`` (a ``engine.RowProcessor``) for one row; compiled grammars are kept in a small
LRU (``GRAMMAR_CACHE`` of them) and freed when they fall out. A constraint that does not compile,
or passes the bounds (``MAX_CONSTRAINT_CHARS`` of text, ``LIMITS`` of the parser), is a one-line
``ConstraintError``.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.safe_io import read_input
from lmcli.text.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "grammar"]
KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "grammar": "grammar",
}
MAX_CONSTRAINT_CHARS = 1 << 18  # 256 KiB of schema, regex or grammar text
GRAMMAR_CACHE = 32  # compiled grammars kept per tokenizer (least recently used dropped)
# The parser's bounds (llguidance's ParserLimits): the grammar's size, the lexer's states and the
# work of one mask; a constraint past them is refused, a step past them ends its row.
LIMITS = {"max_grammar_size": 200_000, "max_lexer_states": 100_000, "step_lexer_fuel": 200_000}
# JSON without free whitespace: ", " and ": " between items (a model that drifts into spaces
# would otherwise spend its tokens there).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(LmcliError):
    """A constraint that does not compile or passes the bounds (one line)."""


@dataclass(frozen=True)
class Constraint:
    """What the rows' text must be: ``kind`` and its ``text`` (a JSON schema as JSON text, a
    regular expression, a Lark grammar; empty for ``json_object``)."""

    kind: Kind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """A JSON schema (a dict, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))

    def grammar(self) -> str:
        """The llguidance grammar of the constraint (raises ``ValueError`` on bad JSON)."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.text)
        schema = self.text if self.kind == "json_schema" else '{"type": "object"}'
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def read_constraint(json_schema: str | None, regex: str | None, grammar: str | None) -> Constraint | None:
    """The constraint of ``lmcli sample``/``chat``'s options: a JSON schema file, a regular
    expression, a Lark grammar file (at most one), or None."""
    from pathlib import Path

    if regex is not None:
        return Constraint("regex", regex)
    for kind, path in (("json_schema", json_schema), ("grammar", grammar)):
        if path is None:
            continue
        data = read_input(Path(path).expanduser(), MAX_CONSTRAINT_CHARS * 4, KIND_NAMES[kind])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConstraintError(f"cannot read {KIND_NAMES[kind]} {path}: {exc}") from None
        return Constraint(kind, text)  # type: ignore[arg-type]
    return None


class Grammars:
    """One tokenizer's grammar compiler, with an LRU of compiled grammars (thread-safe: a
    server compiles its requests' constraints in worker threads)."""

    def __init__(self, tokenizer: Tokenizer, cache: int = GRAMMAR_CACHE) -> None:
        self.tokenizer, self.cache = tokenizer, cache
        self._ll: Any = None  # llguidance's view of the vocabulary, built at the first compile
        self._keep: Tensor | None = None  # (words,) int32: every token's bit but the specials' (<eos> kept)
        self._compiled: collections.OrderedDict[Constraint, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _lltokenizer(self) -> Any:
        if self._ll is None:
            import llguidance

            tokens, specials = self.tokenizer.token_bytes()
            keep = np.full((len(tokens) + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
            for i in specials:
                if i != self.tokenizer.eos_id:  # special tokens are never text
                    keep[i // 32] &= ~np.uint32(1 << (i % 32))
            self._keep = torch.from_numpy(keep.view(np.int32))
            self._ll = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer, tokens, specials)),
                n_vocab=len(tokens),
            )
        return self._ll

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (an llguidance matcher at its start), from the LRU or made now."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
            matcher = self._compile(constraint)
            self._compiled[constraint] = matcher
            while len(self._compiled) > self.cache:
                self._compiled.popitem(last=False)  # freed with its last row
            return matcher

    def _compile(self, constraint: Constraint) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        name = KIND_NAMES[constraint.kind]
        if len(constraint.text) > MAX_CONSTRAINT_CHARS:
            raise ConstraintError(
                f"the {name} is {len(constraint.text):,} characters: more than {MAX_CONSTRAINT_CHARS:,}"
            )
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as exc:
            raise ConstraintError(f"invalid {name}: {_first_line(exc)}") from None
        if constraint.kind == "json_schema":
            _check_satisfiable(constraint.text)
        matcher = LLMatcher(self._lltokenizer(), grammar, log_level=0, limits=LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise ConstraintError(f"invalid {name}: {_first_line(matcher.get_error())}")
        probe = matcher.deep_copy()  # the first mask: a grammar that allows nothing fails here
        probe.compute_bitmask()
        if probe.is_error():
            raise ConstraintError(f"invalid {name}: no text satisfies it ({_first_line(probe.get_error())})")
        return matcher

    def processor(self, constraint: Constraint) -> GrammarMask:
        """A fresh mask for one row (its own copy of the compiled grammar)."""
        matcher = self.compile(constraint).deep_copy()
        assert self._keep is not None
        return GrammarMask(matcher, self._keep, self.tokenizer.eos_id)

    def __len__(self) -> int:
        return len(self._compiled)

    def clear(self) -> None:
        """Forget every compiled grammar."""
        with self._lock:
            self._compiled.clear()


class _Vocabulary:
    """The vocabulary as llguidance's ``TokenizerWrapper`` reads it."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], specials: list[int]) -> None:
        self.tokenizer, self.tokens, self.special_token_ids = tokenizer, tokens, specials
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def _check_satisfiable(text: str) -> None:
    """One line when the JSON schema ``text`` admits no finite value (``schemas.no_finite_value``)."""
    from lmcli.generate.schemas import no_finite_value

    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return  # the compiler has said what is wrong with it
    reason = no_finite_value(schema)
    if reason is not None:
        raise ConstraintError(f"invalid JSON schema: {reason}")


def _first_line(text: Any) -> str:
    """An error of the grammar library in one short line: without its parser's state."""
    line = " ".join(str(text).split()).split(" <state>")[0] or "rejected"
    return line[:300]


class GrammarMask:
    """One row's grammar as a ``RowProcessor``: the tokens it allows next, and the token taken."""

    def __init__(self, matcher: Any, keep: Tensor, eos_id: int) -> None:
        """``keep`` (words,): the bits of the tokenizer's tokens a grammar may allow (not the
        special tokens but ``<eos>``); the model's logits may be wider: the rest is masked."""
        self.matcher, self.keep, self.eos_id = matcher, keep, eos_id
        self.words = keep.numel()  # the mask's 32-bit words

    @classmethod
    def apply(cls, logits: Tensor, processors: list[GrammarMask]) -> Tensor:
        """Logits (G, V) with every token the rows' grammars do not allow at -inf."""
        G, V = logits.shape
        words = max(max(p.words for p in processors), (V + 31) // 32)
        bits = torch.zeros(G, words, dtype=torch.int32)
        for g, p in enumerate(processors):
            if p.matcher.is_stopped() and not p.matcher.is_error():
                bits[g, p.eos_id // 32] = 1 << (p.eos_id % 32)  # complete: only the end
                continue
            p.matcher.unsafe_compute_mask_ptr(bits[g].data_ptr(), 4 * p.words)
            if p.matcher.is_error():
                raise ConstraintError(f"grammar: {_first_line(p.matcher.get_error())}")
        keep = processors[0].keep  # the rows of one engine share a tokenizer
        bits[:, : keep.numel()] &= keep
        if not bits.any(dim=1).all():
            raise ConstraintError(
                "the constraint allows no token of the vocabulary next: it needs text none spells"
            )
        # bit i of word w is token 32 w + i: little-endian bytes, each unpacked low bit first
        allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, count=V, bitorder="little")  # (G, V)
        return logits.masked_fill(torch.from_numpy(allowed).to(logits.device) == 0, float("-inf"))

    def accept(self, token: int) -> None:
        """The row took ``token``: the grammar moves on (a token it did not allow is an error)."""
        if token == self.eos_id and self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"grammar: {_first_line(self.matcher.get_error())}")

    @property
    def ends(self) -> bool:
        """Nothing but ``<eos>`` may follow (the engine lets the row end despite ``min_new_tokens``)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The text so far satisfies the grammar."""
        return self.matcher.is_accepting()
