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
