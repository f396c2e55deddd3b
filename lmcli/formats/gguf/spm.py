"""SentencePiece-style vocabularies as GGUF metadata and back: GGUF's ``llama`` tokenizer model.

A GGUF file of Llama 2, Mistral 7B, TinyLlama or Gemma stores its vocabulary as tokens (by id),
a score for each and a type (normal, unknown, control, user-defined, unused, byte), the special
ids, ``add_bos_token``/``add_eos_token`` and ``add_space_prefix``. llama.cpp tokenizes such a
vocabulary (``src/llama-vocab.cpp``, its SPM tokenizer) as follows, and this module rebuilds the
same with ``tokenizers``:

- user-defined tokens are cut out of the text first, wherever they occur (control tokens too
  when special tokens are parsed, which lmcli never does in a prompt's text);
- each remaining piece gets a space in front when ``add_space_prefix`` is set (default: true),
  if it starts the text or follows a token cut out; then every space becomes ``▁``
  (``tokenizers``: a ``Prepend("▁")`` and ``Replace(" ", "▁")`` normalizer, which runs on each
  piece between added tokens);
- the piece is split into characters, and any two neighbours whose joined text is a token are
  merged, the pair whose token has the highest score first (ties: the leftmost), until no pair
  forms a token; a character that is no token becomes its UTF-8 bytes as ``<0xNN>`` tokens.
  ``tokenizers``: a BPE with byte fallback whose merges are every split of every token into two
  tokens, ranked by the joined token's score (ties by id: the one place the two can differ).

Decoding turns ``▁`` back into spaces, ``<0xNN>`` tokens into their bytes, and drops the
prefixed space.

Out (``spm_vocab``): a ``tokenizer.json`` of that shape (a BPE with byte fallback, spaces as
``▁``; a Llama 2 or Gemma folder's), its scores derived from the merges: a token's score is minus
the rank of its first merge, so llama.cpp merges in the BPE's order. That is exact when the
merges hold every split of every token into two tokens, as the merges Hugging Face derives from a
SentencePiece model do; a BPE whose merges leave one out would merge differently in llama.cpp
and is refused. A ``Metaspace`` pre-tokenizer (Hugging Face's newer Llama tokenizers) reads as
``add_space_prefix``; it differs from llama.cpp only on a text that starts with a space (one
``▁`` where llama.cpp puts two).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lmcli.errors import LmcliError
from lmcli.formats.families.hf_config import HFConfig
from lmcli.text.sentencepiece import SentencePiece
from lmcli.text.tokenizer import Tokenizer

SPACE = "\u2581"  # SentencePiece's ▁: a space inside a token
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType
DEFAULT_IDS = {"unk": 0, "bos": 1, "eos": 2}  # llama.cpp's, when the file names none
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-F]{2}>$")


# ----------------------------------------------------------------------------- in


def check_not_empty(tokens: list[str], types: list[int], where: str) -> None:
    """One line when a normal token is empty text (it must spell something)."""
    empty = [i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if not t and kind == NORMAL]
    if empty:
        raise LmcliError(
            f"{where}: {len(empty)} of its {len(tokens)} tokens are empty text (the first: id {empty[0]}): "
            "a normal token must spell something"
        )


# Bounds of what a vocabulary's merges may cost (see ``token_splits``). Real vocabularies (Llama 2,
# Phi-3, Baichuan, Gemma) make about 2 merges a token, holding about 2 characters for each
# character of their tokens, found by looking at 4 to 8 characters for each; a crafted chain
# ("a", "aa", ..., "a" * K) makes K^2 / 2 merges of K^3 / 3 characters.
MERGES_PER_TOKEN = 4
CHARS_PER_CHAR = 4  # characters of the merges per character of the tokens
LOOKS_PER_CHAR = 32  # characters looked up to find them per character of the tokens
FLOOR = 1 << 16  # what a tiny vocabulary may take whatever its size


def token_splits(ids: dict[str, int], order: Iterable[str], where: str) -> Iterator[tuple[str, str]]:
    """Every cut of each token of ``order`` (texts of ``ids``) into two tokens of ``ids``, as
    (left, right), token by token, cuts in ascending order; one line when they pass the bounds
    of a real vocabulary (``MERGES_PER_TOKEN``, ``CHARS_PER_CHAR``, ``LOOKS_PER_CHAR``).

    Only cuts whose two lengths are lengths of tokens are looked up, so a token longer than
    twice the others costs as many steps as there are lengths, not its length squared."""
    lengths = sorted({len(t) for t in ids})
    have = set(lengths)
    chars = sum(len(t) for t in ids)
    bounds = (
        MERGES_PER_TOKEN * len(ids) + FLOOR,
        CHARS_PER_CHAR * chars + FLOOR,
        LOOKS_PER_CHAR * chars + FLOOR,
    )
    merges = merge_chars = looked = 0
    for token in order:
        n = len(token)
        for cut in lengths:
            if cut >= n:
                break
            if n - cut not in have:
                continue
            looked += n
            left = token[:cut]
            if left in ids and (right := token[cut:]) in ids:
                merges, merge_chars = merges + 1, merge_chars + n
                yield left, right
            if merges > bounds[0] or merge_chars > bounds[1] or looked > bounds[2]:
                raise _too_many(where, len(ids), chars, (merges, merge_chars, looked), bounds)


def _too_many(where: str, n: int, chars: int, counts: tuple[int, ...], bounds: tuple[int, ...]) -> LmcliError:
    what = [
        f"more than {bounds[0]:,} merges, {MERGES_PER_TOKEN} for each of its {n:,} tokens; "
        "a real vocabulary makes about 2",
        f"merges of more than {bounds[1]:,} characters, {CHARS_PER_CHAR} for each character of its "
        "tokens; a real vocabulary's hold about 2",
        f"more than {bounds[2]:,} characters looked up to find its merges, {LOOKS_PER_CHAR} for each "
        "character of its tokens; a real vocabulary needs under 8",
    ][next(i for i, (c, b) in enumerate(zip(counts, bounds, strict=True)) if c > b)]
    return LmcliError(
        f"{where}: its tokens split into two of its tokens in too many ways to build its merges "
        f"({what}): refused"
    )


def spm_merges(
    tokens: list[str], scores: list[float], where: str = "the vocabulary"
) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, ranked by the joined token's score (highest
    first; ties by id): llama.cpp's order of merging (see the module doc); one line when a score
    is NaN (it has no rank) or the merges pass ``token_splits``' bounds."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    # the tokens in the order their merges rank: the merges of one token are consecutive
    return list(token_splits(ids, _merge_order(ids, scores, where), where))


def _list(value: Any, what: str, where: str, kinds: tuple[type, ...]) -> list:
    if not isinstance(value, list) or not all(
        isinstance(v, kinds) and not isinstance(v, bool) for v in value
    ):
        raise LmcliError(f"{where}: {what} is not a list of {kinds[0].__name__}")
    return value


def spm_tokenizer(meta: HFConfig) -> SentencePiece:
    """The tokenizer of a GGUF ``llama`` (SentencePiece-style) vocabulary, held compactly
    (``lmcli.text.sentencepiece``: it encodes as ``spm_hf``'s ``tokenizers`` object, which it
    builds only when asked for its JSON); one line for metadata of the wrong kind or a vocabulary
    whose merges pass ``token_splits``' bounds (checked here, though none is stored: a file
    lmcli runs is one it can export)."""
    get, where = meta.get, meta.where
    tokens = _list(meta.require("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", where, (str,))
    n = len(tokens)
    scores = _list(
        get("tokenizer.ggml.scores", None) or [0.0] * n, "tokenizer.ggml.scores", where, (float, int)
    )
    types = _list(get("tokenizer.ggml.token_type", None) or [NORMAL] * n, "the token types", where, (int,))
    if len(scores) != n or len(types) != n:
        raise LmcliError(f"{where}: {len(scores)} scores and {len(types)} token types for {n} tokens")
    check_not_empty(tokens, types, where)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # another empty token: llama.cpp's name
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)  # a repeated text keeps its first id
    order = _merge_order(ids, scores, where)
    for _ in token_splits(ids, order, where):  # (bounded: one line past a real vocabulary's)
        pass
    ranks = [0] * n
    for rank, t in enumerate(order):
        ranks[ids[t]] = rank
    del ids, order
    space_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
    return SentencePiece(tokens, ranks, types, space_prefix, functools.partial(spm_hf, where=where))


def _merge_order(ids: dict[str, int], scores: list[float], where: str) -> list[str]:
    """The tokens (unique texts) in the order their merges rank: highest score first, ties by
    id; one line for a NaN score (it has no rank)."""
    nan = next((i for i in ids.values() if math.isnan(scores[i])), None)
    if nan is not None:
        raise LmcliError(f"{where}: the score of token {nan} is NaN (scores rank the merges)")
    return sorted(ids, key=lambda t: (-scores[ids[t]], ids[t]))


def spm_hf(vocab: SentencePiece, where: str = "the vocabulary") -> Any:
    """The ``tokenizers`` Tokenizer of a vocabulary (a ``SentencePiece``'s tokens, ranks and
    types): a BPE with byte fallback whose merges are every split of every token
    (``spm_merges``, ranked as the vocabulary ranks its tokens), the space prefix as a
    normalizer, control/unknown tokens special and user-defined ones added."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens, types = vocab.tokens(), list(vocab.types)
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    unk = next((t for t, k in zip(tokens, types, strict=True) if k == UNKNOWN), None)
    merges = spm_merges(tokens, [-float(r) for r in vocab.ranks], where)
    try:
        model = models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        hf = HFTokenizer(model)
        replace = normalizers.Replace(" ", SPACE)
        prefix = vocab.add_space_prefix
        hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        hf.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        added = [
            AddedToken(tokens[i], special=k != USER_DEFINED, normalized=False)
            for i, k in enumerate(types)
            if k in (CONTROL, UNKNOWN, USER_DEFINED) and ids[tokens[i]] == i
        ]
        hf.add_special_tokens([a for a in added if a.special])
        hf.add_tokens([a for a in added if not a.special])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # tokenizers raises plain Exception, or panics (not an Exception)
        raise LmcliError(f"{where}: cannot build its tokenizer: {str(exc)[:200]}") from None
    return hf


# ----------------------------------------------------------------------------- out


@dataclass
class SpmVocab:
    """What GGUF's ``llama`` tokenizer model holds beyond the tokens and their types."""

    scores: list[float]
    add_space_prefix: bool


def is_sentencepiece(spec: dict[str, Any]) -> bool:
    """Whether a ``tokenizer.json`` is SentencePiece-style: a BPE with byte fallback whose text
    has its spaces as ``▁`` (a normalizer or a ``Metaspace`` pre-tokenizer does it)."""
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and _space_prefix(spec) is not None


def _steps(step: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if not step:
        return []
    return (
        [s for inner in step.get(key) or [] for s in _steps(inner, key)]
        if step["type"] == "Sequence"
        else [step]
    )


def _space_prefix(spec: dict[str, Any]) -> bool | None:
    """``add_space_prefix`` of a SentencePiece-style ``tokenizer.json``; None when its
    normalizer and pre-tokenizer are not one of the shapes GGUF's ``llama`` expresses."""
    norm = [json.dumps(s, sort_keys=True) for s in _steps(spec.get("normalizer"), "normalizers")]
    pre = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    replace = json.dumps({"type": "Replace", "pattern": {"String": " "}, "content": SPACE}, sort_keys=True)
    prepend = json.dumps({"type": "Prepend", "prepend": SPACE}, sort_keys=True)
    # Gemma's: spaces split off after the normalizer turned them into ▁ (a split that never cuts)
    inert = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    if norm in ([replace], [prepend, replace]) and all(p == inert for p in pre):
        return norm[0] == prepend
    if not norm and len(pre) == 1 and pre[0]["type"] == "Metaspace" and pre[0].get("replacement") == SPACE:
        if not pre[0].get("split", True):
            return pre[0].get("prepend_scheme", "always") != "never"
    return None


def spm_vocab(tok: Tokenizer, spec: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int], SpmVocab]:
    """Tokens, types and scores of a SentencePiece-style tokenizer (``is_sentencepiece``) as
    GGUF's ``llama`` model holds them (``vocab_size``: the model's; the ids the tokenizer does
    not use are unused tokens); one line when llama.cpp would tokenize it otherwise."""
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges") or []]
    first: dict[str, int] = {}  # token -> rank of the first merge that makes it
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
    pairs = {(left, right) for left, right in merges}
    added = tok.hf.get_added_tokens_decoder()
    specials = {a.content for a in added.values()}
    for left, right in token_splits(vocab, vocab.keys() - specials, "the tokenizer"):
        if (left, right) not in pairs:
            raise LmcliError(
                f"GGUF's SentencePiece vocabulary merges any two tokens that form a token, but this "
                f"tokenizer's merges never join {left!r} and {right!r} into {left + right!r}: "
                "llama.cpp would tokenize it differently"
            )
    by_id = {i: t for t, i in tok.hf.get_vocab(with_added_tokens=True).items()}
    unk = model.get("unk_token") or (tok.token(tok.unk_id) if tok.unk_id is not None else None)
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added and not added[i].special:
            # llama.cpp matches a user-defined token in the text as it is: a ▁ the normalizer
            # would have made is a space there
            tokens.append(text.replace(SPACE, " ") if added[i].normalized else text)
            types.append(USER_DEFINED)
        else:
            tokens.append(text)
            special = i in added
            types.append(
                UNKNOWN
                if text == unk
                else CONTROL
                if special
                else BYTE
                if _BYTE_TOKEN.match(text)
                else NORMAL
            )
        scores.append(-float(first[text]) if text in first else -float(len(merges) + 1))
    return tokens, types, SpmVocab(scores, bool(_space_prefix(spec)))
