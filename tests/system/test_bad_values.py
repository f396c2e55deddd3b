"""Option values of the wrong type or out of range, from TOML files and flags: one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error, make_run
from helpers import run_cli as run

FAST = [*FAST_TRAIN_ARGS, "--max-steps", "2"]


@pytest.mark.parametrize(
    "toml,message",
    [
        (
            "seed = 100000000000000000000",
            "seed must be in [0, 9223372036854775807], got 100000000000000000000",
        ),
        ("seed = -1", "seed must be in [0, 9223372036854775807], got -1"),
        ("save_interval = 100000000000000000000", "save-interval must be below 2**63 in size"),
        ("log_interval = 0.5", "log-interval must be an integer, got 0.5"),
        ("grad_accum = 4.0", "grad-accum must be an integer, got 4.0"),
        ("tokenizer = 5", "tokenizer must be text, got 5"),
        ("max_time = [1, 2]", "max-time must be a number, got [1, 2]"),
        ('corpus = ["c.txt", 5]', "corpus must be a list of text"),
    ],
)
def test_config_file_values_of_the_wrong_type_or_size(
    tmp_path: Path, capsys, toml: str, message: str
) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    corpus = "" if toml.startswith("corpus") else f'\ncorpus = "{tmp_path / "c.txt"}"'
    (tmp_path / "cfg.toml").write_text(toml + corpus + "\n")
    argv = ["train", "--config", str(tmp_path / "cfg.toml")]
    code, _, err = run([*argv, "--out", str(tmp_path / "run"), *FAST], capsys)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def test_a_single_path_for_the_corpus_in_a_config_file_is_a_one_element_list(tmp_path: Path, capsys) -> None:
    """``corpus = "/abs/path"`` must not become one path per character (walking ``/``)."""
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    (tmp_path / "cfg.toml").write_text(f'corpus = "{tmp_path / "c.txt"}"\n')
    code, _, err = run(
        ["train", "--config", str(tmp_path / "cfg.toml"), "--out", str(tmp_path / "run"), *FAST], capsys
    )
    assert code == 0, err
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["train"]["corpus"] == [str(tmp_path / "c.txt")]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["beam", "-p", "the", "--length-penalty", "nan"], "length-penalty must be in [-10, 10], got nan"),
        (["beam", "-p", "the", "--length-penalty", "-inf"], "length-penalty must be in [-10, 10], got -inf"),
        (["beam", "-p", "the", "--length-penalty", "1e308"], "length-penalty must be in [-10, 10]"),
        (["sample", "--seed", "1e23"], "Invalid value for '--seed'"),
        (["sample", "--seed", "100000000000000000000000"], "seed must be in [0, 9223372036854775807]"),
        (["sample", "--num-samples", "1e8"], "Invalid value for '--num-samples'"),
        (["sample", "--max-new-tokens", "100000000000000000000"], "max-new-tokens must be below 2**63"),
        (["beam", "-p", "the", "--beam-size", "100000000000"], "beam-size 100000000000 x 1 input(s) needs"),
    ],
)
def test_decoding_values_out_of_range(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    run_dir = make_run(tmp_path / "run")
    code, _, err = run([argv[0], str(run_dir), *argv[1:]], capsys)
    assert_one_line_error(code, err, message)
