"""`lmcli train` from the command line: options, config files, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error
from helpers import run_cli as run

FAST = [*FAST_TRAIN_ARGS, "--max-steps", "4"]


def test_version_and_help(capsys) -> None:
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.startswith("lmcli ")
    code, out, _ = run(["train", "--help"], capsys)
    assert code == 0 and "--tokenizer" in out and "[default: char]" in out and "--resume" in out


def test_train_then_resume_from_the_command_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    out = tmp_path / "run"
    code, _, err = run(["train", str(tmp_path / "c.txt"), "--out", str(out), *FAST], capsys)
    assert code == 0, err
    assert json.loads((out / "last" / "meta.json").read_text())["step"] == 4
    code, _, err = run(["train", "--resume", str(out), "--max-steps", "6", "-q"], capsys)
    assert code == 0, err
    assert json.loads((out / "last" / "meta.json").read_text())["step"] == 6
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 6


def test_builtin_corpus_is_used_when_none_is_given(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["train", *FAST], capsys)
    assert code == 0, err
    runs = list((tmp_path / "checkpoints").glob("run-*"))
    assert len(runs) == 1 and (runs[0] / "last" / "model.safetensors").exists()
    assert json.loads((runs[0] / "config.json").read_text())["train"]["corpus"] == []
    vocab = json.loads((runs[0] / "last" / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"(", "_", "=", "\n"} <= set(vocab)  # characters of the Python documentation


def test_toml_config_with_flags_overriding_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    (tmp_path / "run.toml").write_text(
        'tokenizer = "byte"\n[model]\nn-layer = 1\nn-head = 2\nn-embd = 16\nblock-size = 16\n'
        "[train]\nbatch-size = 4\nmax-steps = 3\neval-interval = 3\neval-batches = 1\nlr = 0.002\n"
    )
    out = tmp_path / "run"
    code, _, err = run(
        [
            "train",
            str(tmp_path / "c.txt"),
            "--config",
            str(tmp_path / "run.toml"),
            "--out",
            str(out),
            "--lr",
            "0.005",
            "-q",
        ],
        capsys,
    )
    assert code == 0, err
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["train"]["tokenizer"] == "byte" and resolved["train"]["lr"] == 0.005
    assert resolved["model"]["n_layer"] == 1 and resolved["model"]["vocab_size"] == 261


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "c.txt").write_text(TINY_TEXT)
    (tmp / "empty.txt").write_text("")
    (tmp / "short.txt").write_text("abc")
    (tmp / "bad.json").write_text("{not json")
    (tmp / "afile").write_text("x")
    (tmp / "bad.toml").write_text("colour = 3\n")
    (tmp / "mixed.toml").write_text('[optim]\ntokenizer = "byte"\n')
    c = str(tmp / "c.txt")
    return [
        (["train", str(tmp / "missing.txt")], "no such file or folder"),
        (["train", str(tmp / "empty.txt")], "corpus is empty"),
        (["train", c, "--n-embd", "30", "--n-head", "4"], "must be divisible by n-head"),
        (["train", str(tmp / "short.txt")], "fewer than one context window"),
        (["train", c, "--tokenizer", str(tmp / "bad.json")], "cannot read tokenizer"),
        (["train", c, "--tokenizer", str(tmp / "nope.json")], "cannot read tokenizer"),
        (["train", c, "--out", str(tmp / "afile" / "run")], "is not a folder"),
        (["train", c, "--position", "absolute"], "invalid position 'absolute'"),
        (["train", c, "--tokenizer", "wordpiece"], "invalid tokenizer 'wordpiece'"),
        (["train", c, "--lr", "-1"], "lr must be positive"),
        (["train", c, "--max-time", "soon"], "invalid duration"),
        (["train", c, "--config", str(tmp / "bad.toml")], "unknown option(s) colour"),
        (["train", c, "--config", str(tmp / "mixed.toml")], "[optim] has no option(s) tokenizer"),
        (["train", c, "--batch-size", "many"], "batch-size"),
        (["train", c, "--no-such-flag"], "No such option"),
        (["train", "--resume", str(tmp / "norun")], "no such run folder"),
    ]


def test_bad_inputs_give_one_line_and_exit_code_2(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for argv, message in _bad_inputs(tmp_path):
        code, _, err = run(
            [*argv, "--out", str(tmp_path / "out")]
            if "--out" not in argv and "--resume" not in argv
            else argv,
            capsys,
        )
        assert_one_line_error(code, err, message)
        assert not (tmp_path / "out").exists(), f"{argv} left a run folder behind"
        assert not (tmp_path / "checkpoints").exists()


def test_existing_run_folder_is_never_overwritten(tmp_path: Path, capsys) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    out = tmp_path / "run"
    assert run(["train", str(tmp_path / "c.txt"), "--out", str(out), *FAST], capsys)[0] == 0
    before = (out / "last" / "model.safetensors").read_bytes()
    code, _, err = run(["train", str(tmp_path / "c.txt"), "--out", str(out), *FAST], capsys)
    assert_one_line_error(code, err, "already holds files")
    assert (out / "last" / "model.safetensors").read_bytes() == before
