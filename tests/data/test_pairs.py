"""Parallel text: readers, pair encoding, source-masked targets, bucketed batches."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_tokenizer

from lmcli.data.examples import ExampleSampler, collate, tokenize_examples
from lmcli.data.pairs import AlignedFiles, DatasetPairs, TableFile, encode_pair
from lmcli.data.windows import IGNORE
from lmcli.errors import LmcliError
from lmcli.text.tokenizer import Tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def write_pairs(tmp: Path, n: int = 40) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    src, tgt = [], []
    for _ in range(n):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), rng.integers(1, 6))]
        src.append(" ".join(words))
        tgt.append(" ".join(reversed(words)))
    (tmp / "src.txt").write_text("\n".join(src) + "\n")
    with gzip.open(tmp / "tgt.txt.gz", "wt") as f:
        f.write("\n".join(tgt) + "\n")
    return tmp / "src.txt", tmp / "tgt.txt.gz"


def char_tok() -> Tokenizer:
    return tiny_tokenizer(" ".join(WORDS))


def test_aligned_files_read_in_order_including_gz(tmp_path: Path) -> None:
    s, t = write_pairs(tmp_path)
    pairs = list(AlignedFiles(str(s), str(t)).pairs())
    assert len(pairs) == 40
    assert all(tg == " ".join(reversed(sr.split())) for sr, tg in pairs)


def test_line_count_mismatch_names_both_counts(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("1\n2\n3\n")
    (tmp_path / "b.txt").write_text("1\n2\n")
    with pytest.raises(LmcliError, match=r"a.txt has 3 lines, .*b.txt has 2"):
        AlignedFiles(str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))


def test_tsv_jsonl_and_dataset_translation_rows(tmp_path: Path) -> None:
    (tmp_path / "p.tsv").write_text("hello\thallo\nworld\twelt\n")
    assert list(TableFile(str(tmp_path / "p.tsv")).pairs()) == [("hello", "hallo"), ("world", "welt")]
    (tmp_path / "p.jsonl").write_text('{"source": "hello", "target": "hallo"}\n')
    assert list(TableFile(str(tmp_path / "p.jsonl")).pairs()) == [("hello", "hallo")]
    rows = [{"translation": {"en": "hello", "de": "hallo"}}, {"translation": {"en": "cat", "de": "Katze"}}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert list(DatasetPairs(str(tmp_path / "d.jsonl"), "train", "en", "de").pairs())[1] == ("cat", "Katze")


def test_bad_tsv_line_is_named(tmp_path: Path) -> None:
    (tmp_path / "p.tsv").write_text("hello\thallo\nno tab here\n")
    with pytest.raises(LmcliError, match=r"p.tsv:2: expected source<TAB>target"):
        list(TableFile(str(tmp_path / "p.tsv")).pairs())


def test_encode_pair_layout_and_truncation() -> None:
    tok = char_tok()
    ids, prefix, cut = encode_pair([10, 11], [12, 13, 14], tok, 16)
    assert ids == [tok.bos_id, 10, 11, tok.sep_id, 12, 13, 14, tok.eos_id] and prefix == 4 and not cut
    ids, prefix, cut = encode_pair(list(range(20)), list(range(30, 50)), tok, 16)
    assert cut and len(ids) == 16 and ids[-1] != tok.eos_id  # a cut target has no <eos>
    assert prefix - 2 == 6  # the source keeps half the room (16 - 3) // 2


def test_empty_pairs_skipped_and_long_pairs_truncated_are_counted(tmp_path: Path) -> None:
    (tmp_path / "s.txt").write_text("alpha\n\nbeta gamma\n" + "delta " * 30 + "\n")
    (tmp_path / "t.txt").write_text("ahpla\nempty source\n\n" + "atled " * 30 + "\n")
    pairs = tokenize_examples(
        AlignedFiles(str(tmp_path / "s.txt"), str(tmp_path / "t.txt")), char_tok(), 64, tmp_path / "cache"
    )
    assert (pairs.stats.examples, pairs.stats.empty, pairs.stats.truncated) == (2, 2, 1)
    assert max(pairs.length) == 64
    again = tokenize_examples(
        AlignedFiles(str(tmp_path / "s.txt"), str(tmp_path / "t.txt")), char_tok(), 64, tmp_path / "cache"
    )
    assert again.cached and again.stats.truncated == 1 and np.array_equal(again.length, pairs.length)


def test_loss_targets_cover_target_tokens_only(tmp_path: Path) -> None:
    s, t = write_pairs(tmp_path)
    tok = char_tok()
    pairs = tokenize_examples(AlignedFiles(str(s), str(t)), tok, 128, tmp_path / "cache")
    batch = collate(pairs, [0, 1, 2], tok.pad_id, 127)
    for row in range(3):
        seq = pairs.sequence(row).tolist()
        sep = seq.index(tok.sep_id)
        scored = batch.y[row][batch.y[row] != IGNORE].tolist()
        assert scored == seq[sep + 1 :]  # target tokens and <eos>, nothing of the source
        assert int(batch.prefix_len[row]) == sep + 1
        assert tok.decode(scored) == " ".join(reversed(tok.decode(seq[1:sep]).split()))


def test_pair_sampler_is_without_replacement_and_bucketed(tmp_path: Path) -> None:
    s, t = write_pairs(tmp_path, n=400)
    tok = char_tok()
    pairs = tokenize_examples(AlignedFiles(str(s), str(t)), tok, 128, tmp_path / "cache")
    sampler = ExampleSampler(pairs, batch_size=8, seed=0, pad_id=tok.pad_id, context=127)
    epoch = sampler.indices(0, 400)
    assert sorted(epoch) == list(range(400))
    assert sampler.indices(400, 400) != epoch and sorted(sampler.indices(400, 400)) == list(range(400))
    lengths = [pairs.length[sampler.indices(i, 8)] for i in range(0, 400, 8)]
    pad = sum(int((n.max() - n).sum()) for n in lengths)
    total = sum(int(n.max()) * len(n) for n in lengths)
    assert pad / total < 0.1  # bucketing keeps pairs of a batch of similar length
    assert [sampler.batch(i, 8).x.size(1) for i in range(0, 400, 8)] == [int(n.max()) - 1 for n in lengths]
    compiled = ExampleSampler(pairs, batch_size=8, seed=0, pad_id=tok.pad_id, context=127, multiple=64)
    assert {compiled.batch(i, 8).x.size(1) for i in range(0, 400, 8)} <= {64, 127}  # widths repeat


def test_read_lines_splits_at_newlines_only_and_reads_gz(tmp_path: Path) -> None:
    from lmcli.data.corpus import read_lines

    text = "one\u2028still one\r\ntwo\x0cstill two\n\nfour\n"
    (tmp_path / "a.txt").write_text(text, newline="")
    with gzip.open(tmp_path / "a.txt.gz", "wt", newline="") as f:
        f.write(text)
    expected = ["one\u2028still one", "two\x0cstill two", "", "four"]
    assert read_lines(tmp_path / "a.txt") == expected == read_lines(tmp_path / "a.txt.gz")
