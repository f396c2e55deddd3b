"""A SentencePiece-style vocabulary held compactly (``lmcli.text.sentencepiece``): it encodes and
decodes as the ``tokenizers`` object it stands for (``formats.gguf.spm.spm_hf``), token for token
and offset for offset, on vocabularies with every kind of token GGUF holds; it never builds that
object for encoding, decoding or lookups; a copy in another process encodes the same."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys

import pytest

from bench.texts import spm_pieces
from lmcli.formats.families.gguf_schema import GgufSchema
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.gguf.spm import spm_hf, spm_tokenizer
from lmcli.formats.gguf.vocab import tokenizer_from_gguf
from lmcli.text.chat_template import special_parser
from lmcli.text.sentencepiece import SentencePiece

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
ALPHABET = [
    *"abcdefghij klmnop  \n\t<>_",
    "é",
    "中",
    "🙂",
    "\u2581",
    "<start_of_turn>",
    "<img>",
    "    ",
    "<unk>",
]


def meta(tokens: list[str], scores: list[float], types: list[int], prefix: bool = True) -> HFConfig:
    data = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": prefix,
        "tokenizer.ggml.eos_token_id": 1,
    }
    return HFConfig(data, "test.gguf", GgufSchema())


def vocabulary(case: str) -> tuple[list[str], list[float], list[int]]:
    """A Gemma-like made-up vocabulary, and variants of it: a text repeated, an empty control
    token, user-defined tokens (a run of spaces, a marker), and ``no bytes``: two byte tokens
    missing (é and 中 fall back to <unk>, fused)."""
    tokens, scores, types = spm_pieces(20000, seed=3)
    tokens[9000], types[9000] = "    ", USER_DEFINED
    tokens[9001], types[9001] = "<img>", USER_DEFINED
    tokens[9002], tokens[9003] = "ab", "ab"
    tokens[9004], types[9004] = "", CONTROL
    if case == "no bytes":
        for b in (0xC3, 0xE4):
            i = tokens.index(f"<0x{b:02X}>")
            tokens[i], types[i] = f"nobyte{b}", NORMAL
    return tokens, scores, types


@pytest.mark.parametrize("case", ["gemma-like", "no bytes", "no space prefix"])
def test_encodes_and_decodes_as_the_tokenizers_object_it_stands_for(case: str) -> None:
    lean = spm_tokenizer(meta(*vocabulary(case), prefix=case != "no space prefix"))
    assert isinstance(lean, SentencePiece)
    full = spm_hf(lean)
    rng = random.Random(0)
    texts = [
        "",
        " ",
        "a",
        "  a  b",
        "<start_of_turn>user\n",
        *("".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 40))) for _ in range(600)),
    ]
    for specials in (True, False):
        lean.encode_special_tokens = full.encode_special_tokens = specials
        for text in texts:
            ours, theirs = lean.encode(text), full.encode(text, add_special_tokens=False)
            assert (ours.ids, ours.offsets) == (theirs.ids, theirs.offsets), repr(text)
    assert lean.encode("é🙂é").ids == full.encode("é🙂é").ids
    for _ in range(600):
        ids = [rng.randrange(len(lean.first) + 2) for _ in range(rng.randrange(12))]
        ids += rng.sample(range(100, 400), 3)  # specials and byte tokens among them
        rng.shuffle(ids)
        for skip in (True, False):
            assert lean.decode(ids, skip) == full.decode(ids, skip_special_tokens=skip), ids
    assert lean.get_vocab() == full.get_vocab(with_added_tokens=True)
    assert lean.get_vocab_size() == full.get_vocab_size(with_added_tokens=True)
    for i in (0, 1, 9001, 9002, 9003, 9004, 15000, len(lean.first)):
        assert lean.id_to_token(i) == full.id_to_token(i)
    assert lean.token_to_id("ab") == full.token_to_id("ab") == 9002 and lean.token_to_id("zzz-none") is None
    decoder = {i: (t.content, t.special) for i, t in full.get_added_tokens_decoder().items()}
    assert {i: (t.content, t.special) for i, t in lean.get_added_tokens_decoder().items()} == decoder


def test_a_gguf_vocabulary_is_held_compactly_and_never_built_whole_to_sample() -> None:
    """The tokenizer of a GGUF SentencePiece vocabulary holds its texts once, in a few arrays
    (under 30 bytes a token beside the texts' own; tokenizers' maps and merges took ~290), and
    encoding, decoding, the special roles, the longest token and a chat template's parser of
    special tokens never build the ``tokenizers`` object (which a saved tokenizer.json does)."""
    tokens, scores, types = spm_pieces(20000, seed=1)
    types[2], types[3] = CONTROL, UNKNOWN
    tok = tokenizer_from_gguf(meta(tokens, scores, types))
    lean = tok.hf
    assert isinstance(lean, SentencePiece)
    arrays = (lean.starts, lean.ranks, lean.table, lean.first, lean.types)
    held = sum(a.itemsize * len(a) if hasattr(a, "itemsize") else len(a) for a in arrays)
    assert len(lean.text) == sum(len(t.encode()) for t in tokens) and held < 30 * len(tokens)
    ids = tok.encode("hello <start_of_turn> world 中")
    assert tok.decode(ids) == "hello <start_of_turn> world 中"
    parser = special_parser(tok)
    assert parser.encode("<start_of_turn>").ids == [tokens.index("<start_of_turn>")]
    assert tok.encode("<start_of_turn>") != parser.encode("<start_of_turn>").ids  # (text in a prompt)
    assert tok.longest_token == max(map(len, tokens)) and tok.token(5) == tokens[5]
    assert lean._full_tokenizer is None and parser._full_tokenizer is None
    assert '"type":"BPE"' in tok.to_json() and lean._full_tokenizer is not None


COPY = """
import pickle, sys
lean = pickle.loads(sys.stdin.buffer.read())
print(lean.encode(sys.argv[1]).ids)
"""


def test_a_copy_in_another_process_encodes_the_same() -> None:
    """Python's string hash differs between processes: a pickled copy builds its own table."""
    lean = spm_tokenizer(meta(*vocabulary("gemma-like")))
    text = "héllo <img> wörld    中文 🙂"
    done = subprocess.run(
        [sys.executable, "-c", COPY, text],
        input=pickle.dumps(lean),
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip() == str(lean.encode(text).ids)
