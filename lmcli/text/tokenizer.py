"""Tokenizers (char, byte, byte-level BPE) built on Hugging Face ``tokenizers``.

Every tokenizer lmcli trains has the special tokens ``<pad> <unk> <bos> <eos> <sep>`` at ids
0-4. A tokenizer may also name its special tokens itself (a Hugging Face model's, from its
``tokenizer_config.json``/``generation_config.json``): those roles, and a chat template if it has
one, are saved beside ``tokenizer.json`` as Hugging Face's ``tokenizer_config.json`` and read
back from there. Roles it does not name are found by their usual names, with fallbacks.

Whether a text starts with ``<bos>`` (``add_bos``) is the tokenizer's too: lmcli's own tokenizers
always put it first (a model trained by lmcli saw every text so); an imported model's follow
its source (``add_bos_token`` of its ``tokenizer_config.json`` or GGUF metadata), saved as
``add_bos_token`` when it is false. ``with_bos`` is where every command asks.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from lmcli.config.train import TOKENIZER_KINDS
from lmcli.errors import LmcliError
from lmcli.safe_io import check_text, read_input, read_json_object
from lmcli.text.sentencepiece import SentencePiece

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>", "<sep>")
PIECE_CHARS = 1 << 12  # the longest piece BPE trains on or encode_batch encodes (2-4 KiB: ~30% faster)
ROLES = ("bos", "eos", "pad", "unk", "sep")
CONFIG = "tokenizer_config.json"  # beside tokenizer.json: the named roles and the chat template
CONFIG_LIMIT = 64 << 20  # a tokenizer_config.json holds a few MiB at most
TOKENIZER_LIMIT = 512 << 20  # a tokenizer.json (a 256k vocabulary and its merges: ~30 MiB)

# Names tried, in order, for each special role (lmcli's own first, then common conventions).
_ROLE_NAMES = {
    "pad": ("<pad>", "[PAD]"),
    "unk": ("<unk>", "[UNK]"),
    "bos": ("<bos>", "<s>", "<|endoftext|>"),
    "eos": ("<eos>", "</s>", "<|endoftext|>"),
    "sep": ("<sep>", "[SEP]"),
}


def _byte_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE uses for bytes 0..255, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _plain_bytes(text: str) -> bytes:
    """A token's bytes when its text is not byte-level: ``<0xNN>`` (byte fallback) is byte NN,
    ``\u2581`` (SentencePiece's word start) a space, anything else its UTF-8."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    return text.replace("\u2581", " ").encode("utf-8")


def split_pieces(text: str, target: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``target`` characters, cut after a line break, or else
    before a space (where a byte-level BPE word starts), or else anywhere.

    BPE trains and encodes on these pieces: a word is never longer than ``target``, which keeps
    BPE training linear on text with long runs of letters (DNA, minified files).
    """
    start = 0
    while len(text) - start > target:
        cut = text.rfind("\n", start, start + target) + 1
        if cut <= start:
            cut = text.rfind(" ", start + 1, start + target)
        if cut <= start:
            cut = start + target
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def _build(kind: str, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    if kind == "char":
        tok = HFTokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(
            vocab_size=1 << 30, min_frequency=1, special_tokens=list(SPECIAL_TOKENS), show_progress=False
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return tok
    if kind == "byte":
        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(_byte_alphabet())})
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    # byte-level BPE, as GPT-2
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((piece for text in texts for piece in split_pieces(text)), trainer=trainer)
    return tok


class Tokenizer:
    """A thin wrapper: encode/decode, special-token ids, save/load, a content fingerprint."""

    def __init__(
        self,
        tok: HFTokenizer,
        specials: dict[str, str] | None = None,
        chat_template: str | None = None,
        *,
        add_bos: bool = True,
        add_eos: bool = False,
    ) -> None:
        """``specials``: role (bos, eos, pad, unk, sep) -> token text, for roles the tokenizer's
        source names; the others are looked up by their usual names. ``add_bos``: a text starts
        with ``<bos>`` (``with_bos``); ``add_eos``: the source's flag, carried to exports (lmcli
        never ends a prompt with ``<eos>``)."""
        self.hf = tok
        self.add_bos, self.add_eos = add_bos, add_eos
        # Text that happens to contain "<eos>" is text, not a special token.
        self.hf.encode_special_tokens = True
        self.specials = {role: text for role, text in (specials or {}).items() if text is not None}
        self.chat_template = chat_template
        self.origin: str | None = None  # the folder it was read from (messages name it)
        # (looked up one by one: the vocabulary as a dict is 30 MB of Python for 262k tokens)
        for role, text in self.specials.items():
            if tok.token_to_id(text) is None:
                raise LmcliError(f"tokenizer's {role} token {text!r} is not in its vocabulary")
        ids = {
            role: tok.token_to_id(self.specials[role])
            if role in self.specials
            else next((i for i in map(tok.token_to_id, names) if i is not None), None)
            for role, names in _ROLE_NAMES.items()
        }
        if ids["eos"] is None:
            raise LmcliError(
                "tokenizer has no end-of-text token (<eos>, </s> or <|endoftext|>, or an eos_token "
                "in tokenizer_config.json)"
            )
        self.eos_id: int = ids["eos"]
        self.bos_id: int = ids["bos"] if ids["bos"] is not None else self.eos_id
        self.pad_id: int = ids["pad"] if ids["pad"] is not None else self.eos_id
        self.sep_id: int | None = ids["sep"]
        self.unk_id: int | None = ids["unk"]

    def token(self, i: int) -> str:
        """The text of token ``i``."""
        text = self.hf.id_to_token(i)
        if text is None:
            raise LmcliError(f"token id {i} is not in the tokenizer's vocabulary")
        return text

    def config(self) -> dict[str, Any]:
        """Hugging Face's ``tokenizer_config.json`` keys for the named roles, the chat template
        and the ``add_bos_token``/``add_eos_token`` flags that differ from lmcli's own."""
        out: dict[str, Any] = {f"{role}_token": text for role, text in self.specials.items()}
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        if not self.add_bos:  # lmcli's own put <bos> first: only the exception is written
            out["add_bos_token"] = False
        if self.add_eos:
            out["add_eos_token"] = True
        return out

    def with_bos(self, ids: list[int]) -> list[int]:
        """``ids`` as a sequence starts: ``<bos>`` first if the tokenizer adds it, or if there is
        nothing else to start from (an empty text)."""
        return [self.bos_id, *ids] if self.add_bos or not ids else list(ids)

    @classmethod
    def train(cls, kind: str, texts: Iterable[str], vocab_size: int = 8000) -> Tokenizer:
        """Train a ``char``, ``byte`` or ``bpe`` tokenizer on an iterator of texts."""
        if kind not in TOKENIZER_KINDS:
            raise LmcliError(f"invalid tokenizer {kind!r}: choose char, byte, bpe or a tokenizer.json path")
        return cls(_build(kind, texts, vocab_size))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            specials, template = read_config(path.parent / CONFIG)
            add_bos, add_eos = read_flags(path.parent / CONFIG)
            spec = read_input(path, TOKENIZER_LIMIT, "tokenizer").decode("utf-8", errors="replace")
            tok = cls(
                HFTokenizer.from_str(spec),
                specials,
                template,
                add_bos=True if add_bos is None else add_bos,  # lmcli's own: <bos> first
                add_eos=bool(add_eos),
            )
            tok.origin = str(path.parent)
            return tok
        except LmcliError:
            raise
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            reason = "no such file" if not path.exists() else str(exc).splitlines()[0][:200]
            raise LmcliError(f"cannot read tokenizer {path}: {reason}") from None

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` at ``path`` and, when the tokenizer names its special tokens or
        has a chat template, ``tokenizer_config.json`` beside it."""
        self.hf.save(str(path))
        if self.config():
            with open(Path(path).parent / CONFIG, "w") as f:
                json.dump(self.config(), f, indent=2, ensure_ascii=False)
                f.write("\n")

    def to_json(self) -> str:
        return self.hf.to_str()

    @property
    def fingerprint(self) -> str:
        """A hash of the tokenizer's full definition (vocabulary, merges, normalization)."""
        named = json.dumps(self.specials, sort_keys=True) if self.specials else ""  # "": lmcli's own
        return hashlib.sha256((self.to_json() + named).encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def kind(self) -> str:
        """``char``, ``byte``, ``bpe`` or ``other``, read from the tokenizer's model."""
        spec = json.loads(self.to_json())["model"]
        if spec["type"] == "WordLevel":
            return "char"
        if spec["type"] == "BPE":
            return "byte" if not spec.get("merges") else "bpe"
        return "other"

    def encode(self, text: str) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except TypeError:  # "TextInputSequence must be str": a lone surrogate is one line
            check_text(text, "the text")
            raise

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            for i, text in enumerate(texts):
                check_text(text, f"text {i}")
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the longest token: a text of ``n * longest_token`` characters or more
        holds at least ``n`` tokens (a bound found without tokenizing it)."""
        if isinstance(self.hf, SentencePiece):  # (without a dict of its vocabulary)
            return self.hf.longest_token
        return max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)

    def token_bytes(self) -> tuple[list[bytes], list[int]]:
        """Every token's bytes as its text holds them, by id, and the ids of the special tokens
        (whose bytes are their names): what a grammar library matches tokens with. Byte-level
        tokens (bpe, byte, GPT-2-like Hugging Face) map their characters back to bytes; others
        (char, SentencePiece-like) are their UTF-8, ``\u2581`` a space, ``<0xNN>`` byte NN."""
        vocab = self.hf.get_vocab(with_added_tokens=True)
        added = self.hf.get_added_tokens_decoder()
        specials = sorted(i for i, t in added.items() if t.special)
        byte_level = isinstance(self.hf, HFTokenizer) and '"ByteLevel"' in json.dumps(
            json.loads(self.to_json()).get("decoder")
        )  # (a SentencePiece is not, and its JSON is not built for the question)
        alphabet = {c: b for b, c in enumerate(_byte_alphabet())} if byte_level else None
        out = [b""] * self.vocab_size
        for text, i in vocab.items():
            if i in added or alphabet is None:
                out[i] = _plain_bytes(text) if i not in added else text.encode("utf-8")
            else:
                out[i] = b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode("utf-8") for c in text)
        return out, specials

    def count_unknown(self, ids: Iterable[int]) -> int:
        """How many ids are ``<unk>`` (characters the tokenizer could not encode)."""
        return 0 if self.unk_id is None else sum(1 for i in ids if i == self.unk_id)


def token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: text, or {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_config(path: Path) -> tuple[dict[str, str], str | None]:
    """The named roles and the chat template of a ``tokenizer_config.json`` (none if absent); the
    template of a ``chat_template.jinja`` beside it (where transformers now saves it) comes first."""
    specials, template = read_config_json(path)
    jinja = path.parent / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return specials, template


def _config_json(path: Path) -> dict[str, Any]:
    """A ``tokenizer_config.json`` as a dict ({} when absent)."""
    return read_json_object(path, CONFIG_LIMIT)


def read_flags(path: Path) -> tuple[bool | None, bool | None]:
    """``add_bos_token`` and ``add_eos_token`` of a ``tokenizer_config.json`` (None: not a
    boolean there, so the caller's default applies)."""
    data = _config_json(path)
    flags = (data.get("add_bos_token"), data.get("add_eos_token"))
    return tuple(f if isinstance(f, bool) else None for f in flags)  # type: ignore[return-value]


def read_config_json(path: Path) -> tuple[dict[str, str], str | None]:
    """The named roles and the chat template stored in a ``tokenizer_config.json``."""
    if not path.is_file():
        return {}, None
    data = _config_json(path)
    specials = {role: token_text(data.get(f"{role}_token")) for role in ROLES}
    template = data.get("chat_template")  # a list of named templates is not kept
    named = {k: v for k, v in specials.items() if v is not None}
    return named, template if isinstance(template, str) else None
