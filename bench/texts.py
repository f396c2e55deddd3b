"""Text and tokenizers for the suites, all made offline: CPython's documentation topics
(``pydoc_data``, ~0.5 MB of English and code) and tokenizers built from it or from scratch."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from lmcli.text.tokenizer import SPECIAL_TOKENS, Tokenizer, _byte_alphabet


def doc_text() -> str:
    """The documentation topics shipped inside CPython, in a fixed order."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


def char_tokenizer(size: int = 65) -> Tokenizer:
    """An lmcli char tokenizer of exactly ``size`` tokens (5 specials + printable characters)."""
    alphabet = (string.ascii_letters + string.digits + string.punctuation + " \n")[
        : size - len(SPECIAL_TOKENS)
    ]
    tok = Tokenizer.train("char", iter([alphabet]))
    assert tok.vocab_size == size, tok.vocab_size
    return tok


def wide_tokenizer(size: int) -> Tokenizer:
    """A byte-level tokenizer with ``size`` tokens: lmcli's specials, the 256 bytes, and made-up
    multi-byte tokens up to ``size``, so any id a random model emits decodes to text."""
    alphabet = _byte_alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(vocab) + i for i, c in enumerate(alphabet)})
    letters = string.ascii_lowercase
    n = 0
    while len(vocab) < size:
        word, k = "", n
        while True:  # n in base 26, at least two letters
            word = letters[k % 26] + word
            k //= 26
            if k == 0 and len(word) >= 2:
                break
        vocab.setdefault(word, len(vocab))
        n += 1
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok)


def shuffled_lines(seed: int) -> Iterator[str]:
    """An endless stream of documentation lines, reshuffled on every pass, each pass's numbers
    and some words changed so the text varies."""
    lines = [line for line in doc_text().splitlines(keepends=True) if line.strip()]
    words = sorted({w for line in lines[:5000] for w in line.split() if w.isalpha()})
    rng = random.Random(seed)
    while True:
        rng.shuffle(lines)
        for line in lines:
            if rng.random() < 0.3:
                parts = line.split(" ")
                parts[rng.randrange(len(parts))] = rng.choice(words)
                line = " ".join(parts)
                if not line.endswith("\n"):
                    line += "\n"
            if rng.random() < 0.1:
                line = f"{rng.randrange(10**6)} {line}"
            yield line


def spm_pieces(size: int, seed: int = 0) -> tuple[list[str], list[float], list[int]]:
    """A made-up SentencePiece-style vocabulary of ``size`` tokens as GGUF's ``llama`` tokenizer
    model holds it (tokens, scores, types), shaped as Gemma 3's: its special tokens first
    (``<pad> <eos> <bos> <unk>``, then unused ones), the 256 byte tokens ``<0xNN>``, some
    thousands of single characters (Latin, Greek, Cyrillic, CJK, Hangul; spaces as ``▁``), then
    pieces joined from two shorter ones (frequent ones most often, up to 16 characters), so every
    piece splits into two tokens as a trained vocabulary's do. Scores fall with the id."""
    control, unknown, byte, normal = 3, 2, 6, 1  # gguf.TokenType
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]"]
    specials += [f"<unused{i}>" for i in range(99)] + ["<start_of_turn>", "<end_of_turn>"]
    tokens = list(specials)
    types = [unknown if t == "<unk>" else control for t in specials]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    chars = [c for c in string.printable if not c.isspace()] + ["\u2581", "\n", "\t"]
    for lo, hi in ((0xC0, 0x250), (0x391, 0x3CA), (0x410, 0x450), (0x4E00, 0x6000), (0xAC00, 0xAD00)):
        chars += [chr(c) for c in range(lo, hi)]
    first = len(tokens)
    tokens += chars
    rng = random.Random(seed)
    seen = set(tokens)
    words = ["\u2581" + c for c in string.ascii_letters]  # word starts: a space then a letter
    pool = list(chars[:94]) + words  # the pieces joins draw from, frequent (ASCII) ones first
    for w in words:
        seen.add(w)
        tokens.append(w)
    while len(tokens) < size:
        # a rank drawn with density falling as 1/rank: frequent pieces join most often
        a = pool[int(len(pool) ** rng.random()) - 1]
        b = pool[int(min(len(pool), 4000) ** rng.random()) - 1].lstrip("\u2581")
        piece = a + b
        if not b or len(piece) > 16 or piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        pool.append(piece)
    tokens = tokens[:size]
    types += [normal] * (len(tokens) - len(types))
    scores = [0.0] * first + [-float(i) for i in range(len(tokens) - first)]
    return tokens, scores, types


def spm_tokenizer(size: int) -> Tokenizer:
    """lmcli's Tokenizer of ``spm_pieces(size)``, read as a GGUF ``llama`` vocabulary is (a
    SentencePiece-style tokenizer: the file lmcli exports of it holds the same vocabulary)."""
    from lmcli.formats.families.gguf_schema import GgufSchema
    from lmcli.formats.families.hf_config import HFConfig
    from lmcli.formats.gguf.vocab import tokenizer_from_gguf

    tokens, scores, types = spm_pieces(size)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": False,  # (Gemma's)
        "tokenizer.ggml.bos_token_id": tokens.index("<bos>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<pad>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
    }
    return tokenizer_from_gguf(HFConfig(meta, "spm_pieces", GgufSchema()))
