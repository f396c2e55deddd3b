"""Corpus readers, the token cache and batch sampling."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import train_config

from lmcli.data.corpus import BuiltinCorpus, DatasetCorpus, FileCorpus, resolve_paths
from lmcli.data.token_cache import tokenize_corpus
from lmcli.data.train_data import load_train_data
from lmcli.data.windows import WindowSampler, eval_windows
from lmcli.errors import LmcliError
from lmcli.text.tokenizer import Tokenizer


def test_paths_files_folders_globs_and_gz(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "one.txt").write_text("one\n")
    (tmp_path / "a" / "sub" / "two.txt").write_text("two\n")
    (tmp_path / "a" / ".hidden").write_text("secret\n")
    with gzip.open(tmp_path / "three.txt.gz", "wt") as f:
        f.write("three\n")
    files = resolve_paths([str(tmp_path / "a"), str(tmp_path / "*.gz")])
    assert [p.name for p in files] == ["one.txt", "two.txt", "three.txt.gz"]
    assert "".join(FileCorpus([str(p) for p in files]).texts()) == "one\ntwo\nthree\n"


@pytest.mark.parametrize(
    "pattern,message", [("missing.txt", "no such file"), ("*.nothing", "no files match")]
)
def test_missing_inputs_are_named(tmp_path: Path, monkeypatch, pattern: str, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LmcliError, match=message):
        resolve_paths([pattern])


def test_invalid_utf8_is_replaced_and_counted_across_chunk_boundaries(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("lmcli.data.corpus.CHUNK_BYTES", 7)
    raw = "héllo wörld\n".encode() * 5 + b"bad \xff\xfe byte\n" + "ok \ufffd kept\n".encode()
    (tmp_path / "x.txt").write_bytes(raw)
    corpus = FileCorpus([str(tmp_path / "x.txt")])
    text = "".join(corpus.texts())
    assert text.count("héllo wörld") == 5  # multi-byte characters split by chunks survive
    assert corpus.stats.replaced == 2  # the two bad bytes, not the U+FFFD already in the file
    assert corpus.stats.bytes == len(raw)


def test_binary_files_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "img.bin").write_bytes(b"\x89PNG\x00\x00\x01")
    (tmp_path / "t.txt").write_text("text\n")
    corpus = FileCorpus([str(tmp_path)])
    assert "".join(corpus.texts()) == "text\n"
    assert corpus.stats.skipped_binary == 1


def test_builtin_corpus_is_offline_text() -> None:
    corpus = BuiltinCorpus()
    docs = sum(1 for _ in corpus.documents())
    assert docs > 50 and corpus.stats.bytes > 100_000


def test_token_cache_is_reused_and_keyed_by_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("abcabc\n" * 50)
    corpus = FileCorpus([str(tmp_path / "c.txt")])
    char = Tokenizer.train("char", corpus.texts())
    first = tokenize_corpus(corpus, char, tmp_path / "cache", progress=False)
    second = tokenize_corpus(corpus, char, tmp_path / "cache", progress=False)
    assert not first.cached and second.cached
    assert np.array_equal(np.array(first.stream()), np.array(second.stream()))
    assert np.array(first.stream())[-1] == char.eos_id and first.n_tokens == 351
    byte = tokenize_corpus(corpus, Tokenizer.train("byte", iter(())), tmp_path / "cache", progress=False)
    assert not byte.cached  # another tokenizer, another cache entry
    (tmp_path / "c.txt").write_text("changed\n" * 50)
    changed = tokenize_corpus(FileCorpus([str(tmp_path / "c.txt")]), char, tmp_path / "cache", progress=False)
    assert not changed.cached


def test_tokenization_streams_in_bounded_chunks(tmp_path: Path, monkeypatch) -> None:
    seen: list[int] = []
    original = Tokenizer.encode_batch

    def spy(self, texts):
        seen.append(sum(len(t) for t in texts))
        return original(self, texts)

    monkeypatch.setattr("lmcli.data.corpus.CHUNK_BYTES", 4096)
    monkeypatch.setattr("lmcli.data.tokenize.JOB_CHARS", 4096)
    monkeypatch.setattr(Tokenizer, "encode_batch", spy)
    (tmp_path / "big.txt").write_text("some line of text\n" * 5000)  # 90 kB
    tok = Tokenizer.train("byte", iter(()))
    out = tokenize_corpus(FileCorpus([str(tmp_path / "big.txt")]), tok, tmp_path / "c", progress=False)
    assert out.n_tokens == 90_001
    assert len(seen) > 10 and max(seen) <= 8192 + 2 * 4096  # never the whole 90 kB at once


def test_long_lines_are_cut_between_words_into_pieces_that_tokenize_as_the_whole(tmp_path: Path) -> None:
    text = "a fairly long line of words " * 600 + "\n" + "short line\n" + "x" * 9000  # 16.8k, 9k chars
    (tmp_path / "long.txt").write_text(text)
    tok = Tokenizer.train("bpe", iter([text]), vocab_size=300)
    out = tokenize_corpus(FileCorpus([str(tmp_path / "long.txt")]), tok, tmp_path / "c", progress=False)
    ids = out.stream().tolist()
    assert ids[-1] == tok.eos_id
    assert tok.decode(ids[:-1]) == text  # nothing lost or doubled at the cuts
    # cut before spaces, the words' tokens are those of the uncut line (the 9k run of x is cut anywhere)
    first_line = text.split("\n")[0]
    assert ids[: len(tok.encode(first_line))] == tok.encode(first_line)


def test_empty_corpus_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    corpus = FileCorpus([str(tmp_path / "empty.txt")])
    with pytest.raises(LmcliError, match="corpus is empty"):
        tokenize_corpus(corpus, Tokenizer.train("byte", iter(())), tmp_path / "c", progress=False)


def test_sampler_draws_without_replacement_within_an_epoch() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    sampler = WindowSampler(tokens, block_size=10, seed=3)
    assert sampler.epoch_size == 100
    epoch0 = sampler.window_starts(0, 100)
    assert sorted(s // 10 for s in epoch0) == list(range(100))  # every window index exactly once
    assert len({s % 10 for s in epoch0}) > 5  # shifted by a random jitter, not one fixed grid
    assert max(epoch0) + 10 + 1 <= len(tokens)  # every window has its targets
    epoch1 = sampler.window_starts(100, 100)
    assert epoch1 != epoch0 and sorted(s // 10 for s in epoch1) == list(range(100))
    assert sampler.window_starts(0, 100) == epoch0  # a pure function of the position
    batch = sampler.batch(5, 4)
    assert batch.x.shape == (4, 10) and (batch.y == batch.x + 1).all()  # targets: inputs shifted by one


def test_ranks_read_disjoint_slices_of_the_same_stream() -> None:
    sampler = WindowSampler(np.arange(2001, dtype=np.uint16), block_size=10, seed=0)
    batch, world = 4, 2
    rank_windows = [
        set(sampler.window_starts(step * batch * world + r * batch, batch))
        for step in range(10)
        for r in range(world)
    ]
    flat = [w for s in rank_windows for w in s]
    assert len(flat) == len(set(flat)) == 80


def test_sampler_refuses_a_corpus_shorter_than_one_window() -> None:
    with pytest.raises(LmcliError, match="fewer than one context window"):
        WindowSampler(np.arange(10, dtype=np.uint16), block_size=16, seed=0)


def test_eval_windows_are_fixed_and_spread() -> None:
    w = eval_windows(10_001, 10, 7)
    assert w == eval_windows(10_001, 10, 7) and len(w) == 7 and w[0] == 0 and w[-1] == 9990


def test_val_fraction_takes_the_tail_of_the_corpus(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("a" * 900 + "b" * 99)
    cfg = train_config(corpus=(str(tmp_path / "c.txt"),), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    data = load_train_data(cfg, block_size=1, progress=False)
    tok = data.tokenizer
    assert tok.decode(data.val.tolist()) == "b" * 99 and len(data.train) == 900


@pytest.mark.parametrize("fmt", ["json", "parquet", "text"])
def test_datasets_path_reads_local_files(tmp_path: Path, fmt: str) -> None:
    rows = [{"text": f"row number {i}\n"} for i in range(20)]
    if fmt == "json":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = tmp_path / "d.txt"
        path.write_text("".join(r["text"] for r in rows))
    corpus = DatasetCorpus(str(path), "train", "text")
    text = "".join(corpus.texts())
    assert "row number 0" in text and "row number 19" in text and corpus.stats.documents == 20


def test_dataset_with_missing_column_names_the_columns(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(LmcliError, match="no column 'text' .*body"):
        DatasetCorpus(str(tmp_path / "d.jsonl"), "train", "text")


def test_unreachable_hub_dataset_is_a_one_line_error(monkeypatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    # the libraries read these variables when first imported: set their settings too, so the
    # test never waits on the network whatever ran before it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(LmcliError, match="cannot load dataset") as err:
        DatasetCorpus("no-such-user/no-such-dataset-xyz", "train", "text")
    assert "\n" not in str(err.value)
