"""A tokenizer as GGUF metadata and back: byte-level BPE (GGUF's ``gpt2`` tokenizer model), and
SentencePiece-style vocabularies (its ``llama`` model: ``spm.py``).

GGUF holds a byte-level BPE as its tokens (by id), their types (normal, control: a special
token; user-defined: an added token matched in text; unused), its merges, the pre-tokenizer by
name (``tokenizer.ggml.pre``: llama.cpp's table of split rules), the special ids (bos, eos, pad,
unk, sep), ``add_bos_token``/``add_eos_token`` and the chat template. Hugging Face's
``tokenizers`` holds the same as a ``tokenizer.json``: a BPE model, added tokens, a pre-tokenizer
and a byte-level decoder. ``PRE_TOKENIZERS`` names the pre-tokenizers both sides know, as
``tokenizers`` writes them, each the split rules of llama.cpp's type of that name
(``src/llama-vocab.cpp``):

- ``gpt-2``: GPT-2's regex (lmcli's bpe, GPT-2);
- ``smollm``: every digit alone, then GPT-2's regex (SmolLM, StarCoder);
- ``llama-bpe``: Llama 3's regex, digits in runs of up to three; llama.cpp also takes a word the
  vocabulary holds whole before merging it (``ignore_merges``) and puts ``<bos>`` first unless the
  file says otherwise;
- ``qwen2``: Qwen2's regex, every digit alone.

Out (``gguf_vocab``): the source's pre-tokenizer is found in the table (one line naming it when
it is not there); ``add_bos_token`` as the tokenizer says. In (``tokenizer_from_gguf``): the
table gives the pre-tokenizer of the file's name (a few other names llama.cpp reads the same way
too); ``add_bos_token`` when the file says, else llama.cpp's default for the pre-tokenizer.

lmcli's byte tokenizer is the same model with no merges; llama.cpp requires the merges key and
``gguf`` cannot write an empty array, so it gets one inert merge of two special tokens (a pair no
text can produce, as merges only join byte-level pieces). The char tokenizer maps whole
characters to ids and unknown ones to ``<unk>``: no GGUF tokenizer model does that, so it is
refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lmcli.errors import LmcliError
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.gguf.spm import DEFAULT_IDS, SpmVocab, is_sentencepiece, spm_tokenizer, spm_vocab
from lmcli.text.tokenizer import Tokenizer

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _sequence(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(steps)}


# GGUF's pre-tokenizer name -> the ``tokenizers`` pre-tokenizer that splits text the same way
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "gpt-2": _byte_level(True),
    "smollm": _sequence({"type": "Digits", "individual_digits": True}, _byte_level(True)),
    "llama-bpe": _sequence(_split(_LLAMA3 + _REST), _byte_level(False)),
    "qwen2": _sequence(_split(_QWEN2 + _REST), _byte_level(False)),
}
# other names llama.cpp gives the same split rules (read, never written)
PRE_ALIASES = {
    "llama3": "llama-bpe",
    "llama-v3": "llama-bpe",
    "deepseek-r1-qwen": "qwen2",
    "starcoder": "smollm",
    "refact": "smollm",
    "codeshell": "smollm",
    "phi-2": "gpt-2",
    "mpt": "gpt-2",
    "olmo": "gpt-2",
}
ADDS_BOS = ("llama-bpe", "llama")  # llama.cpp puts <bos> first for these unless the file says otherwise
IGNORES_MERGES = ("llama-bpe",)  # a word the vocabulary holds whole is not merged piece by piece
NORMALIZERS = (None, {"type": "NFC"})  # Qwen2's NFC: llama.cpp leaves text as it is


def _steps(pre: dict[str, Any] | None) -> list[tuple]:
    """A pre-tokenizer as the list of what each of its steps does (for comparing two)."""
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return [s for p in pre.get("pretokenizers") or [] for s in _steps(p)]
    kind = pre.get("type")
    if kind == "ByteLevel":
        return [(kind, bool(pre.get("use_regex", True)), bool(pre.get("add_prefix_space")))]
    if kind == "Digits":
        return [(kind, bool(pre.get("individual_digits")))]
    if kind == "Split":
        pattern = pre.get("pattern") or {}
        return [(kind, json.dumps(pattern, sort_keys=True), pre.get("behavior"), bool(pre.get("invert")))]
    return [(kind, json.dumps(pre, sort_keys=True))]


def pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """GGUF's name of a ``tokenizer.json``'s pre-tokenizer; one line when GGUF has none."""
    steps = _steps(spec.get("pre_tokenizer"))
    for name, pre in PRE_TOKENIZERS.items():
        if steps == _steps(pre):
            return name
    if not (spec.get("model") or {}).get("merges") and steps == _steps(_byte_level(False)):
        return "gpt-2"  # lmcli's byte tokenizer: no merges, so the split changes nothing
    what = (spec.get("pre_tokenizer") or {}).get("type", "none")
    raise LmcliError(
        f"GGUF export supports byte-level BPE tokenizers with the pre-tokenizer of "
        f"{', '.join(PRE_TOKENIZERS)}, not this one ({what})"
    )


# ----------------------------------------------------------------------------- out


@dataclass
class GgufVocab:
    """A tokenizer as GGUF's ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece) model sees it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]  # gpt2 only
    special_ids: dict[str, int]  # bos, eos, pad, unk, sep
    pre: str  # tokenizer.ggml.pre
    add_bos: bool
    add_eos: bool
    spm: SpmVocab | None = None  # llama only: scores, add_space_prefix


def _merge_text(merge: str | list[str]) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def check_bpe(spec: dict[str, Any]) -> None:
    """One line unless ``spec`` (a ``tokenizer.json``) is a plain byte-level BPE."""
    model = spec.get("model") or {}
    if model.get("type") == "WordLevel":
        raise LmcliError(
            "GGUF cannot express lmcli's char tokenizer (whole characters, unknown ones to <unk>): "
            "train with --tokenizer byte or bpe to export GGUF"
        )
    plain = not any(
        model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
    )
    if model.get("type") != "BPE" or not plain or spec.get("normalizer") not in NORMALIZERS:
        what = model.get("type") if model.get("type") != "BPE" else "a BPE with a normalizer or options"
        raise LmcliError(
            f"GGUF export supports byte-level BPE tokenizers and SentencePiece-style ones (a BPE with "
            f"byte fallback, spaces as \u2581), not this one ({what})"
        )


def _special_ids(tok: Tokenizer) -> dict[str, int]:
    special_ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    for role in ("unk", "sep"):
        if getattr(tok, f"{role}_id", None) is not None:
            special_ids[role] = getattr(tok, f"{role}_id")
    return special_ids


def gguf_vocab(tok: Tokenizer, vocab_size: int, token_types: Any) -> GgufVocab:
    """GGUF tokenizer metadata of a byte-level BPE or byte tokenizer (``gpt2``) or of a
    SentencePiece-style one (``llama``); others refused.

    ``vocab_size``: the model's; ids the tokenizer does not use are filled with unused tokens.
    ``token_types``: ``gguf.TokenType``.
    """
    spec = json.loads(tok.to_json())
    if tok.vocab_size > vocab_size:
        raise LmcliError(f"tokenizer has {tok.vocab_size} tokens, the model only {vocab_size}")
    if is_sentencepiece(spec):
        tokens, types, spm = spm_vocab(tok, spec, vocab_size)
        return GgufVocab(tokens, types, [], _special_ids(tok), "default", tok.add_bos, tok.add_eos, spm)
    check_bpe(spec)
    pre = pre_tokenizer_name(spec)
    by_id = {i: t for t, i in tok.hf.get_vocab(with_added_tokens=True).items()}
    added = tok.hf.get_added_tokens_decoder()
    TT = token_types
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
        else:
            tokens.append(by_id[i])
            special = i in added and added[i].special
            types.append(TT.CONTROL if special else TT.USER_DEFINED if i in added else TT.NORMAL)
    merges = [_merge_text(m) for m in spec["model"].get("merges") or []]
    special_ids = _special_ids(tok)
    if not merges:  # the byte tokenizer: one merge no byte-level piece can match (see the module doc)
        controls = [tokens[i] for i in range(vocab_size) if types[i] == TT.CONTROL]
        if len(controls) < 2:
            raise LmcliError("GGUF export of a BPE tokenizer without merges needs two special tokens")
        merges = [f"{controls[0]} {controls[1]}"]
    return GgufVocab(tokens, [int(t) for t in types], merges, special_ids, pre, tok.add_bos, tok.add_eos)


def write_vocab(writer: Any, vocab: GgufVocab, chat_template: str | None) -> None:
    """The tokenizer's metadata into a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model("gpt2" if vocab.spm is None else "llama")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.spm is not None:
        writer.add_token_scores(vocab.spm.scores)
    writer.add_token_types(vocab.types)
    if vocab.spm is None:
        writer.add_token_merges(vocab.merges)
    else:
        writer.add_add_space_prefix(vocab.spm.add_space_prefix)
    for role, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if chat_template:
        writer.add_chat_template(chat_template)


# ----------------------------------------------------------------------------- in

SPECIAL_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: GGUF's spelling
}
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # gguf.TokenType


def _applicable(merges: list[str], vocab: dict[str, int]) -> list[list[str]]:
    """The merges that can apply: both parts and their join in the vocabulary. The others never
    fire (lmcli's byte tokenizer writes one such placeholder, see the module doc), and
    ``tokenizers`` would fail on them."""
    pairs = [m.split(" ", 1) for m in merges]
    return [p for p in pairs if len(p) == 2 and p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]


def bpe_spec(tokens: list[str], types: list[int], merges: list[str], pre: str) -> dict[str, Any]:
    """The ``tokenizer.json`` of a GGUF byte-level BPE: control tokens special, user-defined
    ones added (matched in text), the pre-tokenizer of GGUF's name ``pre``."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated text keeps its first id
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": t == CONTROL,
        }
        for i, t in enumerate(types)
        if t in (CONTROL, USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre in IGNORES_MERGES,
            "vocab": vocab,
            "merges": _applicable(merges, vocab),
        },
    }


def check_not_empty(tokens: list[str], types: list[int], where: str) -> None:
    """One line when a normal token is empty text (it must spell something)."""
    empty = [i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if not t and kind == NORMAL]
    if empty:
        raise LmcliError(
            f"{where}: {len(empty)} of its {len(tokens)} tokens are empty text (the first: id {empty[0]}): "
            "a normal token must spell something"
        )


def _texts(value: Any, what: str, where: str, kind: type = str) -> list:
    """``value`` if it is a list of ``kind``; one line otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise LmcliError(f"{where}: {what} is not a list of {kind.__name__}")
    return value


def tokenizer_from_gguf(meta: HFConfig) -> Tokenizer:
    """lmcli's Tokenizer of a GGUF file's metadata (keys as the file names them); one line for
    a tokenizer model or pre-tokenizer lmcli lacks, or metadata of the wrong kind."""
    get, where = meta.get, meta.where
    kind = get("tokenizer.ggml.model", None)
    if kind == "llama":
        hf, pre, defaults = spm_tokenizer(meta), "llama", DEFAULT_IDS
    elif kind == "gpt2":
        hf, pre, defaults = _bpe_tokenizer(meta), _pre(meta), {}
    else:
        raise LmcliError(
            f"{where}: unsupported GGUF tokenizer model {kind!r} (lmcli reads gpt2, a byte-level BPE, "
            "and llama, a SentencePiece-style vocabulary)"
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    specials = {}
    for role, key in SPECIAL_KEYS.items():
        i = get(key, defaults.get(role))
        if isinstance(i, int) and 0 <= i < len(tokens):
            specials[role] = tokens[i]
    add_bos = get("tokenizer.ggml.add_bos_token", None)
    try:
        return Tokenizer(
            hf,
            specials,
            get("tokenizer.chat_template", None) or None,
            add_bos=bool(add_bos) if add_bos is not None else pre in ADDS_BOS,
            add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
        )
    except LmcliError as exc:
        raise LmcliError(f"{where}: {exc}") from None


def _pre(meta: HFConfig) -> str:
    """The pre-tokenizer of a ``gpt2`` vocabulary, by the name lmcli knows it."""
    name = meta.get("tokenizer.ggml.pre", "gpt-2")
    pre = PRE_ALIASES.get(name, name)
    if pre not in PRE_TOKENIZERS:
        raise LmcliError(
            f"{meta.where}: unsupported GGUF pre-tokenizer {name!r} (lmcli reads {', '.join(PRE_TOKENIZERS)})"
        )
    return pre


def _bpe_tokenizer(meta: HFConfig) -> Any:
    """The ``tokenizers`` Tokenizer of a GGUF ``gpt2`` vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer

    get, where, pre = meta.get, meta.where, _pre(meta)
    tokens = _texts(meta.require("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", where)
    types = _texts(get("tokenizer.ggml.token_type", None) or [1] * len(tokens), "the token types", where, int)
    merges = _texts(get("tokenizer.ggml.merges", None) or [], "tokenizer.ggml.merges", where)
    if len(types) != len(tokens):
        raise LmcliError(f"{where}: {len(types)} token types for {len(tokens)} tokens")
    check_not_empty(tokens, types, where)
    spec = bpe_spec(tokens, types, merges, pre)
    try:
        hf = HFTokenizer.from_str(json.dumps(spec))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # tokenizers raises plain Exception, or panics (not an Exception)
        raise LmcliError(f"{where}: cannot build its tokenizer: {str(exc)[:200]}") from None
    return hf
