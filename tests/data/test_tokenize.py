"""Tokenizing into token shards: the ids and document ends of every source kind, workers giving
the same shards as one process, a streamed dataset, a killed tokenization resumed."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_TEXT, tiny_tokenizer

from lmcli.data.corpus import DatasetCorpus, FileCorpus
from lmcli.data.token_shards import open_token_folder
from lmcli.data.tokenize import write_token_folder
from lmcli.errors import LmcliError

DOCS = ["the cat sat on the mat.\n" * 30, "a bird sang.\n", "the dog sat on the log.\n" * 45]


def expected_ids(tok, texts: list[str]) -> tuple[list[int], list[int]]:
    """Each document encoded whole and followed by <eos>; the <eos> positions."""
    ids, eos = [], []
    for text in texts:
        ids += tok.encode(text)
        eos.append(len(ids))
        ids.append(tok.eos_id)
    return ids, eos


def write_files(folder: Path, texts: list[str]) -> list[str]:
    folder.mkdir(exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        (folder / f"doc{i}.txt").write_text(text)
        paths.append(str(folder / f"doc{i}.txt"))
    return paths


def test_shards_hold_the_ids_and_the_end_of_every_document(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    files = write_files(tmp_path / "c", DOCS)
    folder = write_token_folder(FileCorpus(files), tok, tmp_path / "t", shard_tokens=300, progress=False)
    ids, eos = expected_ids(tok, DOCS)
    stream = folder.stream()
    assert stream.tolist() == ids and len(stream.pieces) > 1  # 1,779 tokens in shards of 300 or more
    ends = [int(e) + off for p, off in zip(stream.pieces, stream.offsets, strict=False) for e in p.eos]
    assert ends == eos
    assert all(len(p) >= 300 for p in stream.pieces[:-1])
    reopened = open_token_folder(tmp_path / "t")  # what lmcli train DIR opens: checked, the same
    assert reopened.stream().tolist() == ids and reopened.tokenizer().fingerprint == tok.fingerprint
    assert folder.index["documents"] == 3 and folder.index["dtype"] == "uint16"


def test_worker_processes_write_the_shards_one_process_writes(tmp_path: Path, monkeypatch) -> None:
    tok = tiny_tokenizer(kind="bpe", vocab_size=300)
    files = write_files(tmp_path / "c", DOCS * 4)
    one = write_token_folder(
        FileCorpus(files), tok, tmp_path / "one", workers=1, shard_tokens=500, progress=False
    )
    monkeypatch.setattr("lmcli.data.tokenize.POOL_AFTER", 0)  # workers from the first job on
    monkeypatch.setattr("lmcli.data.tokenize.JOB_CHARS", 700)
    monkeypatch.setattr("lmcli.data.tokenize.encode_items", None)  # nothing encoded in this process
    two = write_token_folder(
        FileCorpus(files), tok, tmp_path / "two", workers=2, shard_tokens=500, progress=False
    )
    assert two.stream().tolist() == one.stream().tolist() == expected_ids(tok, DOCS * 4)[0]
    assert np.concatenate(
        [p.eos + o for p, o in zip(two.stream().pieces, two.stream().offsets, strict=False)]
    ).tolist() == [
        int(e) + o for p, o in zip(one.stream().pieces, one.stream().offsets, strict=False) for e in p.eos
    ]


def test_jsonl_parquet_zst_and_gz_files_are_read_as_their_rows_or_text(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rows = [{"body": DOCS[0], "n": 1}, {"body": None}, {"body": DOCS[1]}]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    pq.write_table(pa.Table.from_pylist([{"body": DOCS[2]}]), tmp_path / "b.parquet")
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(DOCS[1].encode()))
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl))
    corpus = FileCorpus(
        [str(tmp_path / n) for n in ("a.jsonl.zst", "b.parquet", "c.txt.zst", "d.jsonl.gz")], "body"
    )
    texts = ["".join(doc) for doc in corpus.documents()]
    assert texts == [DOCS[0], DOCS[1], DOCS[2], DOCS[1], DOCS[0], DOCS[1]]  # null rows skipped


@pytest.mark.parametrize(
    "name,data,message",
    [
        ("x.txt.zst", b"(\xb5/\xfd" + b"\x00" * 20, "corrupt or truncated zstd data"),
        ("x.jsonl", b'{"text": "a"}\n{"body": "b"}\n', 'x.jsonl:2: expected a "text" field (found: body)'),
        ("x.jsonl", b'{"text": "a"}\nnot json\n', "x.jsonl:2: not a JSON object"),
        ("x.parquet", b"PAR1 not really", "cannot read"),
    ],
    ids=["corrupt-zst", "jsonl-column", "jsonl-syntax", "parquet"],
)
def test_a_bad_file_is_named_in_one_line(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(LmcliError, match=re.escape(message)) as info:
        list(FileCorpus([str(tmp_path / name)]).texts())
    assert "\n" not in str(info.value)


def test_a_truncated_zst_file_is_named_not_read_short(tmp_path: Path) -> None:
    import zstandard

    data = zstandard.ZstdCompressor().compress(TINY_TEXT.encode() * 50)
    (tmp_path / "x.txt.zst").write_bytes(data[: len(data) // 2])
    with pytest.raises(LmcliError, match="corrupt or truncated zstd data"):
        list(FileCorpus([str(tmp_path / "x.txt.zst")]).texts())


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_local_dataset_is_streamed_and_tokenized(tmp_path: Path, fmt: str) -> None:
    import datasets

    rows = [{"text": DOCS[i % 3], "id": i} for i in range(6)]
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    corpus = DatasetCorpus(str(path), "train", "text")
    assert isinstance(corpus.dataset, datasets.IterableDataset)  # streaming=True: nothing loaded first
    tok = tiny_tokenizer()
    folder = write_token_folder(corpus, tok, tmp_path / "t", progress=False)
    assert folder.stream().tolist() == expected_ids(tok, [r["text"] for r in rows])[0]
    assert folder.index["documents"] == 6


SLOW_CORPUS = """
import sys, time
from pathlib import Path
from helpers import tiny_tokenizer
from lmcli.data.corpus import FileCorpus
from lmcli.data.tokenize import write_token_folder

class Stalls(FileCorpus):
    # the same files (the same key), but reading stops for good before the last third of them
    def documents(self):
        for i, doc in enumerate(super().documents()):
            if i == 2 * len(self.files) // 3:
                print("stalled", flush=True)
                time.sleep(600)
            yield doc

files = sys.argv[2:]
out = Path(sys.argv[1])
write_token_folder(Stalls(files), tiny_tokenizer(), out, workers=1, shard_tokens=400, progress=False)
"""


def test_a_killed_tokenization_resumes_keeping_the_finished_shards(tmp_path: Path, capsys) -> None:
    """SIGKILL in the middle of tokenizing: the next run keeps every finished shard as it is,
    tokenizes the rest, and the folder equals an uninterrupted one."""
    files = write_files(tmp_path / "c", DOCS * 6)
    out = tmp_path / "t"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CORPUS, str(out), *files], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "stalled\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finished = sorted(out.glob("shard-*.json"))
    assert len(finished) >= 3 and not (out / "index.json").exists()
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*")}
    tok = tiny_tokenizer()
    resumed = write_token_folder(FileCorpus(files), tok, out, workers=1, shard_tokens=400, progress=False)
    assert f"resuming, {len(finished)} finished shard(s) kept" in capsys.readouterr().err
    for record in finished:
        for ext in (".bin", ".docs", ".json"):
            now = out / record.name.replace(".json", ext)
            assert (now.stat().st_ino, now.stat().st_mtime_ns) == before[now.name]  # kept, not redone
    whole = write_token_folder(
        FileCorpus(files), tok, tmp_path / "whole", workers=1, shard_tokens=400, progress=False
    )
    assert resumed.stream().tolist() == whole.stream().tolist() == expected_ids(tok, DOCS * 6)[0]
    assert [r["n_tokens"] for r in resumed.index["shards"]] == [r["n_tokens"] for r in whole.index["shards"]]
    assert not list(out.glob("*.lmtmp")) and not list(out.glob(".*.lmtmp"))  # the killed writer's temp went
