"""The caches and the corpus are input too: damaged ones are rebuilt or named in one line."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error, run_cli, tiny_tokenizer, train_config

from lmcli.data.examples import tokenize_examples
from lmcli.data.pairs import AlignedFiles
from lmcli.data.train_data import load_train_data


def corrupt_gzip(path: Path, text: str) -> Path:
    """A .gz whose header is fine and whose deflate body is not."""
    data = bytearray(gzip.compress(text.encode() * 20))
    for i in range(12, len(data) - 12):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))
    return path


def test_a_corrupt_gzip_corpus_is_named_in_one_line(tmp_path: Path, capsys) -> None:
    bad = corrupt_gzip(tmp_path / "c.txt.gz", TINY_TEXT)
    code, _, err = run_cli(["train", str(bad), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], capsys)
    assert_one_line_error(code, err, f"cannot read {bad}: corrupt or truncated gzip data")
    assert not (tmp_path / "r").exists()


def test_a_corrupt_gzip_prompt_file_is_named_in_one_line(tiny_run: Path, tmp_path: Path, capsys) -> None:
    bad = corrupt_gzip(tmp_path / "prompts.gz", "the cat\n")
    code, _, err = run_cli(["sample", str(tiny_run), "--prompt-file", str(bad)], capsys)
    assert_one_line_error(code, err, f"cannot read {bad}: corrupt or truncated gzip data")


def test_corrupt_gzip_parallel_text_is_named_in_one_line(tmp_path: Path) -> None:
    src = corrupt_gzip(tmp_path / "src.gz", "a cat\n")
    (tmp_path / "tgt").write_text("eine katze\n" * 20)
    with pytest.raises(Exception, match="corrupt or truncated gzip data") as info:
        AlignedFiles(str(src), str(tmp_path / "tgt"))
    assert type(info.value).__name__ == "LmcliError"


def _stream(tmp_path: Path, cache: Path):
    corpus = tmp_path / "c.txt"
    if not corpus.exists():  # the same file (size, mtime): the same cache key
        corpus.write_text(TINY_TEXT)
    cfg = train_config(corpus=(str(corpus),), cache_dir=str(cache))
    return load_train_data(cfg, block_size=16, tokenizer=tiny_tokenizer(), progress=False, info=print)


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: _zero(f / "shard-00000.bin"),  # zeros: would train on them silently
        lambda f: (f / "shard-00000.bin").write_bytes(np.random.default_rng(0).bytes(2000)),
        lambda f: (f / "shard-00000.bin").write_bytes((f / "shard-00000.bin").read_bytes()[:-2]),
        lambda f: (f / "shard-00000.docs").write_bytes(b""),  # where the documents end, lost
        lambda f: (f / "index.json").write_text("{not json"),
        lambda f: (f / "index.json").write_text('{"format": "lmcli-tokens", "dtype": "int8", "shards": 3}'),
    ],
    ids=["zeros", "random", "truncated", "no-documents", "broken-json", "foreign-json"],
)
def test_a_damaged_token_cache_is_rebuilt(tmp_path: Path, capsys, damage) -> None:
    cache = tmp_path / "cache"
    first = np.array(_stream(tmp_path, cache).train)
    (folder,) = cache.glob("tokens-*")
    damage(folder)
    again = _stream(tmp_path, cache)
    err = capsys.readouterr().err
    assert f"warning: token cache {folder} is damaged" in err and "rebuilding it" in err
    assert not again.info["cached"]
    assert np.array_equal(np.array(again.train), first)
    third = _stream(tmp_path, cache)  # and the rebuilt cache is reused quietly
    assert third.info["cached"] and "warning" not in capsys.readouterr().err


def test_an_unfinished_cache_with_a_damaged_shard_record_is_redone_from_there(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = np.array(_stream(tmp_path, cache).train)
    (folder,) = cache.glob("tokens-*")
    (folder / "index.json").unlink()  # as a killed writer leaves it
    (folder / "shard-00000.json").write_text('{"name": "shard-00000", "n_tokens": "many"}')
    again = _stream(tmp_path, cache)
    assert np.array_equal(np.array(again.train), first) and (folder / "index.json").exists()


def test_a_damaged_pair_cache_is_rebuilt(tmp_path: Path, capsys) -> None:
    (tmp_path / "src").write_text("a cat sat\nthe dog\n" * 10)
    (tmp_path / "tgt").write_text("eine katze\nder hund\n" * 10)
    tok = tiny_tokenizer("a cat sat the dog eine katze der hund\n")
    corpus = AlignedFiles(str(tmp_path / "src"), str(tmp_path / "tgt"))
    first = tokenize_examples(corpus, tok, 32, tmp_path)
    expected = [first.sequence(i).tolist() for i in range(len(first))]
    (npy,) = tmp_path.glob("examples-*.npy")
    index = np.load(npy)
    index[0] += 10**6  # offsets beyond the tokens: today an IndexError or garbage pairs
    np.save(npy, index)
    again = tokenize_examples(corpus, tok, 32, tmp_path)
    assert "warning: example cache" in capsys.readouterr().err
    assert [again.sequence(i).tolist() for i in range(len(again))] == expected
    (bin_path,) = tmp_path.glob("examples-*.bin")
    bin_path.write_bytes(bytes(bin_path.stat().st_size))
    third = tokenize_examples(corpus, tok, 32, tmp_path)
    assert "warning: example cache" in capsys.readouterr().err
    assert [third.sequence(i).tolist() for i in range(len(third))] == expected


def test_a_broken_cached_tokenizer_is_trained_again(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TINY_TEXT)
    cfg = train_config(corpus=(str(corpus),), cache_dir=str(tmp_path / "cache"))
    first = load_train_data(cfg, block_size=16, progress=False)
    (cached,) = (tmp_path / "cache").glob("tokenizer-*.json")
    cached.write_text('{"model": ')
    again = load_train_data(cfg, block_size=16, progress=False)
    assert "training it again" in capsys.readouterr().err
    assert again.tokenizer.fingerprint == first.tokenizer.fingerprint
    assert json.loads(cached.read_text())  # rewritten whole


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_files_of_dead_writers_are_removed_at_the_next_start(tmp_path: Path) -> None:
    """What a SIGTERM during tokenization leaves (a pid-tagged temp file) goes at the next start;
    a live writer's temp file stays."""
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / f".tokens-0123.bin.{dead_pid()}.x1y2z3.lmtmp"
    stale.write_bytes(b"\0" * 4096)
    live = cache / f".tokens-0123.bin.{os.getppid()}.a1b2c3.lmtmp"
    live.write_bytes(b"\0")
    _stream(tmp_path, cache)
    assert not stale.exists() and live.exists()
    assert not [p for p in cache.iterdir() if p.name.endswith(".lmtmp") and p != live]


def test_sigterm_during_tokenization_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    """A real SIGTERM in the middle of tokenizing a corpus: its temp file is pid-tagged, and the
    next run removes it."""
    cache = tmp_path / "cache"
    corpus = tmp_path / "big.txt"
    corpus.write_text(TINY_TEXT * 2000)  # 4 MB: tokenizing takes a moment
    env = {**os.environ, "LMCLI_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    code = (
        "import sys; from helpers import train_config; from lmcli.data.train_data import load_train_data;"
        "from lmcli.text.tokenizer import Tokenizer;"
        f"tok = Tokenizer.train('char', iter([{TINY_TEXT!r}]));"
        "sys.stdout.write('ready\\n'); sys.stdout.flush();"
        f"cfg = train_config(corpus=({str(corpus)!r},));"
        "load_train_data(cfg, block_size=16, tokenizer=tok, progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    temps: list[Path] = []
    for _ in range(2000):  # until its temp file appears (bounded)
        temps = list(cache.glob("tokens-*/.shard-*")) if cache.exists() else []
        if temps or proc.poll() is not None:
            break
        subprocess.run(["sleep", "0.01"])
    proc.terminate()
    proc.wait(timeout=60)
    if not temps:
        pytest.skip("tokenization finished before the signal")
    assert all(t.name.endswith(".lmtmp") and f".{proc.pid}." in t.name for t in temps)
    small = tmp_path / "small.txt"
    small.write_text(TINY_TEXT)
    cfg = train_config(corpus=(str(small),), cache_dir=str(cache))
    load_train_data(cfg, block_size=16, tokenizer=tiny_tokenizer(), progress=False)
    assert not list(cache.glob("**/*.lmtmp"))
