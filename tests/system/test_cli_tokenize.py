"""`lmcli tokenize` end to end: a folder of token shards that `lmcli train DIR` trains on (at
documents' starts, attention within documents), and its bad inputs in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error, read_metrics, run_cli

STEPS = ["--max-steps", "4", "--log-interval", "2"]


@pytest.fixture
def tokenized(tmp_path: Path, capsys) -> Path:
    """A corpus of JSONL rows tokenized by `lmcli tokenize` into several shards."""
    rows = [{"text": TINY_TEXT[i * 101 : i * 101 + 300]} for i in range(15)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tokens"
    args = ["tokenize", str(tmp_path / "rows.jsonl"), "--out", str(out), "--shard-tokens", "1000"]
    code, _, err = run_cli([*args, "--cache-dir", str(tmp_path / "cache")], capsys)
    assert code == 0, err
    assert "15 document(s)" in err and len(list(out.glob("shard-*.bin"))) > 1
    code, _, err = run_cli([*args, "--cache-dir", str(tmp_path / "cache")], capsys)
    assert code == 0 and "already tokenized" in err  # the same corpus and tokenizer: reused
    return out


@pytest.mark.slow
def test_train_reads_a_token_folder_at_documents_starts_with_a_document_mask(
    tokenized: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    flags = ["--align-documents", "--document-mask", "--out", str(run)]
    code, _, err = run_cli(["train", str(tokenized), *FAST_TRAIN_ARGS, *STEPS, *flags], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run) if "train_loss" in r] == [2, 4]
    assert json.loads((run / "last" / "tokenizer.json").read_text()) == json.loads(
        (tokenized / "tokenizer.json").read_text()
    )
    code, out, err = run_cli(["sample", str(run), "-p", "the", "--max-new-tokens", "5"], capsys)
    assert code == 0 and out.strip(), err


def test_a_token_folder_missing_a_shard_is_named_in_one_line(tokenized: Path, tmp_path: Path, capsys) -> None:
    (tokenized / "shard-00001.bin").unlink()
    code, _, err = run_cli(["train", str(tokenized), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], capsys)
    assert_one_line_error(code, err, f"{tokenized} is missing shard shard-00001.bin (listed in index.json)")
    assert not (tmp_path / "r").exists()


def test_an_unfinished_token_folder_is_named_in_one_line(tokenized: Path, tmp_path: Path, capsys) -> None:
    (tokenized / "index.json").unlink()  # as a killed lmcli tokenize leaves it
    code, _, err = run_cli(["train", str(tokenized), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], capsys)
    assert_one_line_error(code, err, "is unfinished: its tokenization stopped after")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tokenizer", "bpe"], "is tokenized already, with its own tokenizer: drop --tokenizer"),
        (["EXTRA"], "is a folder of token shards: give it as the only corpus"),
    ],
    ids=["another-tokenizer", "with-text"],
)
def test_a_token_folder_trains_alone_with_its_own_tokenizer(
    tokenized: Path, tmp_path: Path, capsys, args: list[str], message: str
) -> None:
    (tmp_path / "more.txt").write_text(TINY_TEXT)
    args = [str(tmp_path / "more.txt") if a == "EXTRA" else a for a in args]
    code, _, err = run_cli(
        ["train", str(tokenized), *args, *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], capsys
    )
    assert_one_line_error(code, err, message)


def test_tokenize_bad_inputs_are_one_line(tokenized: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "other.txt").write_text("something else entirely\n" * 20)
    cases = [
        (["tokenize", str(tmp_path / "other.txt")], "give --out DIR"),
        (["tokenize", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "x")], "no such file or folder"),
        (
            ["tokenize", str(tmp_path / "other.txt"), "-o", str(tokenized)],
            "holds the tokens of another corpus",
        ),
        (
            ["tokenize", str(tmp_path / "other.txt"), "-o", str(tmp_path)],
            "is not empty and holds no token shards",
        ),
        (["tokenize", str(tokenized), "-o", str(tmp_path / "y")], "is a folder of token shards already"),
        (["tokenize", str(tmp_path / "other.txt"), "-o", str(tmp_path / "z"), "--workers", "-1"], "workers"),
    ]
    for argv, message in cases:
        code, _, err = run_cli([*argv, "--cache-dir", str(tmp_path / "cache")], capsys)
        assert_one_line_error(code, err, message)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_documents_options_are_refused_for_whole_examples(tmp_path: Path, capsys) -> None:
    (tmp_path / "pairs.tsv").write_text("a cat\teine katze\n" * 20)
    args = ["train", str(tmp_path / "pairs.tsv"), "--task", "translation", "--document-mask"]
    code, _, err = run_cli([*args, *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r")], capsys)
    assert_one_line_error(code, err, "--align-documents and --document-mask apply to a token stream")
