"""Issue 40, findings 6-10 (docs/bad-inputs.md rows 400-): a resume that would train another run,
a `tokenize` retried after a failure, unsatisfiable JSON schemas, NaN or empty GGUF files,
export into a read-only folder, bad task rows, and an MFU above 100%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error, run_cli

# ----------------------------------------------------------------------------- 6: resume


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An lm run from scratch (c.txt), a second copy of it, and an sft run ``--init-from`` the
    first: tiny models, 2 steps each."""
    import shutil

    from lmcli.cli.app import main

    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "c.txt").write_text(TINY_TEXT)
    (tmp / "d.txt").write_text(TINY_TEXT.upper())
    rows = [{"prompt": "the cat", "response": "sat on the mat."}] * 20
    (tmp / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fast = [*FAST_TRAIN_ARGS, "--block-size", "48", "--max-steps", "2", "--cache-dir", str(tmp / "cache")]
    for argv in (
        ["train", str(tmp / "c.txt"), "--out", str(tmp / "lm"), *fast],
        ["train", "--task", "sft", str(tmp / "sft.jsonl"), "--init-from", str(tmp / "lm")]
        + ["--out", str(tmp / "sft"), *fast],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
            raise SystemExit(0)
        assert info.value.code in (0, None), argv
    shutil.copytree(tmp / "lm", tmp / "lm2")
    return {"tmp": tmp, "lm": tmp / "lm", "lm2": tmp / "lm2", "sft": tmp / "sft"}


def config_of(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())["train"]


@pytest.mark.parametrize(
    "run, argv, message",
    [
        (  # the case: an sft run resumed as lm, from another base, on another corpus
            "sft",
            ["--task", "lm", "{tmp}/c.txt", "--init-from", "{lm2}"],
            "--task lm: {sft} is a --task sft run, and a resume keeps its task "
            "(to train it as lm: a new run with --init-from {sft})",
        ),
        (  # the reverse: it said "cannot resume a run trained with --optimizer muon ..."
            "lm",
            ["--task", "sft", "{tmp}/sft.jsonl"],
            "--task sft: {lm} is a --task lm run, and a resume keeps its task",
        ),
        (
            "sft",
            ["--init-from", "{lm2}"],
            "--init-from {lm2}: {sft} was started from {lm}, and a resume keeps its base",
        ),
        ("lm", ["--init-from", "{sft}"], "--init-from {sft}: {lm} was trained from scratch"),
        (
            "lm",
            ["{tmp}/d.txt"],
            "the corpus {tmp}/d.txt: {lm} trained on corpus {tmp}/c.txt; give --allow-new-data",
        ),
        ("lm", ["--val-fraction", "0.5"], "--val-fraction 0.5: {lm} trained on val fraction 0.1"),
        ("lm", ["--tokenizer", "byte"], "--tokenizer: {lm} has its own tokenizer, and a resume keeps it"),
        ("lm", ["--allow-new-data", "--task", "sft"], "--task sft: {lm} is a --task lm run"),
    ],
    ids=["sft-as-lm", "lm-as-sft", "other-base", "a-base-added", "corpus", "val-split", "tokenizer", "allow"],
)
def test_a_resume_that_would_train_another_run_is_refused_naming_the_flag(
    runs: dict[str, Path], capsys, run: str, argv: list[str], message: str
) -> None:
    """Row 400: each refused in one line before anything is written; the run's config unchanged."""
    names = {k: str(v) for k, v in runs.items()}
    before = (runs[run] / "config.json").read_text()
    argv = [a.format(**names) for a in argv]
    code, _, err = run_cli(["train", "--resume", names[run], *argv, "--max-steps", "3", "-q"], capsys)
    assert_one_line_error(code, err, message.format(**names))
    assert (runs[run] / "config.json").read_text() == before
    assert json.loads((runs[run] / "last" / "meta.json").read_text())["step"] == 2


def test_a_resume_keeps_its_data_unless_allowed(runs: dict[str, Path], capsys, tmp_path: Path) -> None:
    """The run's own corpus given again (by a relative path) resumes; another one resumes with
    ``--allow-new-data`` only, and the run's config then records it."""
    import os
    import shutil

    run = tmp_path / "lm"
    shutil.copytree(runs["lm"], run)
    cwd = os.getcwd()
    os.chdir(runs["tmp"])
    try:
        code, _, err = run_cli(["train", "--resume", str(run), "c.txt", "--max-steps", "3", "-q"], capsys)
    finally:
        os.chdir(cwd)
    assert code == 0, err
    d = str(runs["tmp"] / "d.txt")
    code, _, err = run_cli(["train", "--resume", str(run), d, "--max-steps", "4", "-q"], capsys)
    assert_one_line_error(code, err, "give --allow-new-data to resume on other (or moved) data")
    argv = ["train", "--resume", str(run), d, "--allow-new-data", "--max-steps", "4", "-q"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert config_of(run)["corpus"] == [d]
    assert json.loads((run / "last" / "meta.json").read_text())["step"] == 4
