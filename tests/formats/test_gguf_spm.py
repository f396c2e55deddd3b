"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model = "llama"``): rebuilt from the
metadata token for token as transformers' tokenizers of the same vocabulary and llama.cpp's own
tokenizer encode, written back on export, refused in one line where GGUF cannot say it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from check_gguf import SPM_CASES, check_spm  # noqa: E402
from gguf_files import SPM_STRESS as TEXTS  # noqa: E402
from gguf_files import SpmSource, field, spm_source, write_gguf_model  # noqa: E402
from helpers import MiB, assert_one_line_error, run_cli, run_measured  # noqa: E402
from tokenizers import AddedToken, decoders, models, normalizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from transformers.tokenization_utils_base import generate_merges  # noqa: E402

from lmcli.errors import LmcliError  # noqa: E402
from lmcli.formats.export.gguf import write_gguf  # noqa: E402
from lmcli.formats.gguf.load import read_gguf_header  # noqa: E402
from lmcli.formats.gguf.vocab import gguf_vocab  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402
from lmcli.text.tokenizer import Tokenizer  # noqa: E402


def spm_file(tmp_path: Path, style: str, add_bos: bool | None = True) -> Path:
    return write_gguf_model(
        tmp_path / f"{style}.gguf", "llama", "F32", spm=spm_source(style), add_bos=add_bos
    )


def transformers_tokenizer(style: str):
    """transformers' own tokenizer class of the style (LlamaTokenizer, GemmaTokenizer) built from
    the same tokens and scores, its merges by transformers' ``generate_merges``; control tokens
    special, user-defined ones added (as transformers' GGUF loader does); special-token text in
    a text is text, as in lmcli's prompts and llama.cpp's ``special=False``."""
    spm = spm_source(style)
    vocab = {t: i for i, t in enumerate(spm.tokens)}
    merges = generate_merges(vocab, dict(zip(spm.tokens, spm.scores, strict=True)))
    cls = transformers.GemmaTokenizer if style == "gemma" else transformers.LlamaTokenizer
    tok = cls(vocab=vocab, merges=merges)
    TT = gguf.TokenType
    control = [t for t, k in zip(spm.tokens, spm.types, strict=True) if k in (TT.CONTROL, TT.UNKNOWN)]
    tok.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    user = [t for t, k in zip(spm.tokens, spm.types, strict=True) if k == TT.USER_DEFINED]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tok.backend_tokenizer.encode_special_tokens = True
    return tok


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_encodes_as_transformers_tokenizer_of_the_same_vocabulary(tmp_path: Path, style: str) -> None:
    tok = read_gguf_header(spm_file(tmp_path, style)).tokenizer
    theirs = transformers_tokenizer(style)
    spm = spm_source(style)
    for text in TEXTS:
        ids = tok.encode(text)
        # transformers' Llama (Metaspace) puts no ▁ in front of a text that starts with a space;
        # SentencePiece and llama.cpp do (so "  a" is "▁▁▁a"): give it that space itself
        prefixed = " " + text if style == "llama" and text.startswith(" ") else text
        assert ids == theirs.encode(prefixed, add_special_tokens=False, split_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert any(spm.types[i] == gguf.TokenType.BYTE for i in tok.encode(TEXTS[0]))  # byte fallback ran
    if style == "gemma":  # user-defined tokens are matched whole in text, control ones are not
        assert tok.encode("<start_of_image>") == [spm.tokens.index("<start_of_image>")]
        assert spm.tokens.index("    ") in tok.encode("a     b")  # a run of spaces matched whole
        assert spm.tokens.index("<start_of_turn>") not in tok.encode("<start_of_turn>")
    specials = (tok.bos_id, tok.eos_id, tok.unk_id)
    assert specials == (spm.bos, spm.eos, spm.unk) and tok.add_bos


def test_metadata_without_special_ids_or_flags_reads_as_llama_cpp_defaults(tmp_path: Path) -> None:
    """No bos/eos/unk ids, no add_bos_token, no add_space_prefix: llama.cpp's defaults for a
    SentencePiece vocabulary (1, 2, 0; <bos> first; a space in front)."""
    spm = spm_source("llama")
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(spm.tokens)
    w.add_token_scores(spm.scores)
    w.add_token_types(spm.types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    from lmcli.formats.families.gguf_schema import GgufSchema
    from lmcli.formats.families.hf_config import HFConfig
    from lmcli.formats.gguf.vocab import tokenizer_from_gguf

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tok = tokenizer_from_gguf(HFConfig(meta, str(path), GgufSchema()))
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.add_bos) == (0, 1, 2, True)
    assert tok.token(tok.encode("hello")[0]).startswith("\u2581")


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_export_writes_the_vocabulary_back(tmp_path: Path, style: str) -> None:
    src = spm_file(tmp_path, style, add_bos=style == "llama")
    ckpt = load_model(src, dtype=torch.float32)
    out = write_gguf(ckpt.model, ckpt.tokenizer, tmp_path / "out.gguf", "f32")
    theirs, ours = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert field(ours, "tokenizer.ggml.model") == "llama"
    for key in (
        "tokens",
        "token_type",
        "add_space_prefix",
        "bos_token_id",
        "eos_token_id",
        "unknown_token_id",
    ):
        assert field(ours, f"tokenizer.ggml.{key}") == field(theirs, f"tokenizer.ggml.{key}"), key
    assert field(ours, "tokenizer.ggml.add_bos_token") is (style == "llama")
    # the scores order every merge as the source's do (the values themselves are ranks)
    old, new = field(theirs, "tokenizer.ggml.scores"), field(ours, "tokenizer.ggml.scores")
    merged = [i for i, t in enumerate(field(theirs, "tokenizer.ggml.tokens")) if len(t) > 1 and old[i] < 0]
    assert sorted(merged, key=lambda i: -old[i]) == sorted(merged, key=lambda i: -new[i])
    back = load_model(out).tokenizer
    for text in TEXTS:
        assert back.encode(text) == ckpt.tokenizer.encode(text), text


def test_a_transformers_llama_tokenizer_exports_as_sentencepiece(tmp_path: Path) -> None:
    """A Hugging Face folder's SentencePiece-style tokenizer.json (transformers' LlamaTokenizer:
    a BPE with byte fallback, a Metaspace pre-tokenizer) is written as GGUF's llama model."""
    hf = transformers_tokenizer("llama")
    tok = Tokenizer(HFTokenizer.from_str(hf.backend_tokenizer.to_str()), {"bos": "<s>", "eos": "</s>"})
    spm = spm_source("llama")
    vocab = gguf_vocab(tok, len(spm.tokens), gguf.TokenType)
    assert vocab.spm is not None and vocab.spm.add_space_prefix
    assert vocab.tokens == spm.tokens and vocab.types == spm.types


def test_a_bpe_llama_cpp_would_merge_otherwise_is_refused() -> None:
    """A byte-fallback BPE whose merges leave out a split of a token into two tokens: llama.cpp
    merges by score any two pieces that form a token, so it would tokenize the text otherwise."""
    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "ab": 5, "bc": 6, "abc": 7}
    bpe = HFTokenizer(models.BPE(vocab, [("a", "b"), ("b", "c"), ("ab", "c")], byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    with pytest.raises(LmcliError, match="never join 'a' and 'bc' into 'abc'"):
        gguf_vocab(Tokenizer(bpe), 8, gguf.TokenType)


def test_bad_spm_metadata_is_one_line(tmp_path: Path, capsys) -> None:
    spm = spm_source("llama")
    spm.scores = spm.scores[:-1]
    path = write_gguf_model(tmp_path / "bad.gguf", "llama", "F32", spm=spm)
    code, out, err = run_cli(["sample", str(path), "-p", "hi", "--max-new-tokens", "1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "scores" in err and "Traceback" not in err


def test_sample_runs_on_a_gemma_style_file(tmp_path: Path, capsys) -> None:
    path = spm_file(tmp_path, "gemma")
    code, out, err = run_cli(
        ["sample", str(path), "-p", "The quick", "--max-new-tokens", "3", "--json", "--temperature", "0"],
        capsys,
    )
    assert code == 0, err
    record = json.loads(out)
    ckpt = load_model(path)
    prompt = ckpt.tokenizer.with_bos(ckpt.tokenizer.encode("The quick"))
    assert prompt[0] == ckpt.tokenizer.bos_id
    with torch.no_grad():
        assert record["tokens"][0] == int(ckpt.model(torch.tensor([prompt]))[0, -1].argmax())


# ----------------------------------------------------------------------------- crafted vocabularies


def every_split(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges by their definition: every cut of every token into two tokens, ranked by the
    joined token's score, ties by id (the first id of a repeated text)."""
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    merges = [
        (-scores[i], i, t[:cut], t[cut:])
        for t, i in first.items()
        for cut in range(1, len(t))
        if t[:cut] in first and t[cut:] in first
    ]
    return [(a, b) for *_, a, b in sorted(merges, key=lambda m: (m[0], m[1]))]


def test_merges_are_every_split_of_every_token_in_score_order() -> None:
    """spm_merges looks up only the cuts whose two lengths are lengths of tokens: the merges are
    still every split, in the same order, on vocabularies with long tokens and equal scores."""
    from lmcli.formats.gguf.spm import spm_merges

    for style in ("llama", "gemma"):
        spm = spm_source(style)
        assert spm_merges(spm.tokens, spm.scores) == every_split(spm.tokens, spm.scores)
    tokens = ["a", "b", "ab", "ba", "aab", "abab", "b" * 40, "b" * 20, "ab" * 20, "a", "bab", "b" * 41]
    scores = [-1.0, -1.0, -2.0, -2.0, -3.0, -2.0, -5.0, -4.0, -4.0, -9.0, 0.0, -5.0]
    assert spm_merges(tokens, scores) == every_split(tokens, scores)


def test_a_nan_score_is_one_line(tmp_path: Path, capsys) -> None:
    """A NaN score has no rank among the others (Python's sort left the merges in an order that
    depended on how it compared them): refused."""
    spm = spm_source("llama")
    spm.scores[300] = float("nan")
    path = write_gguf_model(tmp_path / "nan.gguf", "llama", "F32", spm=spm)
    code, _, err = run_cli(["verify", str(path)], capsys)
    assert_one_line_error(code, err, f"{path}: the score of token 300 is NaN (scores rank the merges)")


def chain(n: int) -> SpmSource:
    """Llama 2's special and byte tokens, then "a", "aa", ..., "a" * n, scored -1, -2, ..."""
    TT = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [int(TT.UNKNOWN), int(TT.CONTROL), int(TT.CONTROL), *[int(TT.BYTE)] * 256]
    tokens += ["a" * k for k in range(1, n + 1)]
    types += [int(TT.NORMAL)] * n
    scores = [0.0] * 259 + [-float(k) for k in range(1, n + 1)]
    return SpmSource(tokens, scores, types, True, 1, 2, 0)


def test_crafted_vocabularies_cost_what_a_real_one_does(tmp_path: Path) -> None:
    """A chain "a" ... "a" * 1000 (its every split a merge: 500k merges of 330M characters; it
    took 1.1 GB, "a" * 2000 a Rust abort) is refused in one line; one token of a million "b"s
    (each of its cuts was looked up: two minutes) loads in the time of the vocabulary without it."""
    spm = chain(1000)
    crafted = write_gguf_model(tmp_path / "chain.gguf", "llama", "Q8_0", spm=spm)
    spm = chain(58)  # 317 tokens
    spm.tokens.append("b" * 1_000_000)
    spm.types.append(int(gguf.TokenType.NORMAL))
    spm.scores.append(-100.0)
    long = write_gguf_model(tmp_path / "long.gguf", "llama", "Q8_0", spm=spm)
    commands = [["verify", str(crafted)], ["sample", str(long), "-p", "Hi bbbb", "--max-new-tokens", "2"]]
    refused, sampled = run_measured(commands, timeout=120)
    assert refused["code"] == 2 and refused["err"].count("\n") == 1, refused["err"]
    assert "too many ways to build its merges" in refused["err"] and "Traceback" not in refused["err"]
    assert sampled["code"] == 0, sampled["err"]
    for result in (refused, sampled):
        assert result["seconds"] < 20 and result["peak"] < 100 * MiB, result


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed")
@pytest.mark.parametrize("case", SPM_CASES)
def test_llama_cpp_tokenizes_as_lmcli(tmp_path: Path, case: str) -> None:
    """llama.cpp's own tokenizer on the file (and on lmcli's export of it) equals lmcli's."""
    result = check_spm(case, tmp_path, None)
    assert result.ok, "\n".join(result.lines)
