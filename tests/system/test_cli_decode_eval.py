"""`lmcli sample`, `beam`, `eval` and `export` end to end, and their one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, make_run, train_config
from helpers import run_cli as run


def test_sample_streams_one_prompt_and_writes_jsonl(tiny_run: Path, capsys) -> None:
    code, out, _ = run(
        ["sample", str(tiny_run), "-p", "the cat", "--max-new-tokens", "12", "--seed", "1"], capsys
    )
    assert code == 0 and out.startswith("the cat") and len(out.rstrip("\n")) > len("the cat")
    code, out, _ = run(
        [
            "sample",
            str(tiny_run),
            "-p",
            "the",
            "-p",
            "a",
            "--num-samples",
            "2",
            "--json",
            "--max-new-tokens",
            "8",
            "--min-new-tokens",
            "8",
            "--temperature",
            "0.7",
            "--top-k",
            "5",
        ],
        capsys,
    )
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(records) == 4
    assert {(r["prompt"], r["sample"]) for r in records} == {("the", 0), ("the", 1), ("a", 0), ("a", 1)}
    assert all(len(r["logprobs"]) == len(r["tokens"]) and r["settings"]["top_k"] == 5 for r in records)
    assert all(len(r["tokens"]) == 8 for r in records)  # --min-new-tokens 8: no early <eos>


def test_sample_defaults_to_the_newest_run_and_empty_prompt(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "checkpoints" / "run-a")
    import os
    import time

    old = tmp_path / "checkpoints" / "run-a" / "last" / "meta.json"
    os.utime(old, (time.time() - 100, time.time() - 100))
    make_run(tmp_path / "checkpoints" / "run-b", text="xyz zyx\n" * 20)
    code, out, err = run(
        ["sample", "--max-new-tokens", "30", "--temperature", "1"], capsys, stdin="", monkeypatch=monkeypatch
    )
    assert code == 0, err
    assert set(out) <= set("xyz \n") and out.strip()  # only run-b's characters


def test_unknown_characters_warn(tiny_run: Path, capsys) -> None:
    code, _, err = run(["sample", str(tiny_run), "-p", "the ☃", "--max-new-tokens", "3"], capsys)
    assert code == 0 and "1 character(s) unknown to the tokenizer" in err


def test_beam_writes_one_line_per_input_in_order(tiny_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "in.txt").write_text("the cat\n\na bird sang\nthe\n")
    out_file = tmp_path / "out.txt"
    code, _, err = run(
        [
            "beam",
            str(tiny_run),
            "-i",
            str(tmp_path / "in.txt"),
            "-o",
            str(out_file),
            "--beam-size",
            "3",
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    assert len(out_file.read_text().splitlines()) == 4
    code, out, _ = run(
        [
            "beam",
            str(tiny_run),
            "-i",
            str(tmp_path / "in.txt"),
            "--nbest",
            "2",
            "--beam-size",
            "3",
            "--max-new-tokens",
            "6",
            "--json",
        ],
        capsys,
    )
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3] and records[2]["input"] == "a bird sang"
    assert all(
        len(r["hypotheses"]) == 2 and r["hypotheses"][0]["score"] >= r["hypotheses"][1]["score"]
        for r in records
    )


def test_beam_reads_stdin_and_scores_bleu(tiny_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "ref.txt").write_text("x\ny\n")
    code, out, err = run(
        ["beam", str(tiny_run), "--reference", str(tmp_path / "ref.txt"), "--max-new-tokens", "4"],
        capsys,
        stdin="the\na\n",
        monkeypatch=monkeypatch,
    )
    assert code == 0 and len(out.splitlines()) == 2 and "BLEU" in err and "chrF" in err


def test_eval_reports_and_per_line_jsonl(tiny_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "t.txt").write_text("the cat sat on the mat.\nthe dog sat.\n")
    code, out, _ = run(["eval", str(tiny_run), str(tmp_path / "t.txt"), "--json", "--stride", "8"], capsys)
    report = json.loads(out)
    assert code == 0 and report["tokens"] == len("the cat sat on the mat.\nthe dog sat.\n")
    assert report["bits_per_byte"] > 0 and report["perplexity"] > 1
    code, out, _ = run(
        ["eval", str(tiny_run), str(tmp_path / "t.txt"), "--per-line", "-o", str(tmp_path / "l.jsonl")],
        capsys,
    )
    assert code == 0 and len((tmp_path / "l.jsonl").read_text().splitlines()) == 2


def test_export_then_eval_the_hf_folder(tiny_run: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "t.txt").write_text("the cat sat on the mat.\n")
    assert run(["export", str(tiny_run), str(tmp_path / "hf"), "--format", "hf"], capsys)[0] == 0
    _, ours, _ = run(["eval", str(tiny_run), str(tmp_path / "t.txt"), "--json"], capsys)
    _, theirs, _ = run(["eval", str(tmp_path / "hf"), str(tmp_path / "t.txt"), "--json"], capsys)
    assert json.loads(ours)["perplexity"] == pytest.approx(json.loads(theirs)["perplexity"], rel=1e-6)


def _corrupt(run_dir: Path, how: str) -> None:
    weights = run_dir / "best" / "model.safetensors"
    if how == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "truncate-unverified":
        weights.write_bytes(weights.read_bytes()[:100])
        for name in ("best", "last"):
            meta = json.loads((run_dir / name / "meta.json").read_text())
            meta.pop("sha256")
            (run_dir / name / "meta.json").write_text(json.dumps(meta))
    elif how == "vocab":
        other = make_run(run_dir.parent / "other", text="xyz only three letters\n" * 5)
        (run_dir / "best" / "tokenizer.json").write_bytes((other / "best" / "tokenizer.json").read_bytes())
        meta = json.loads((run_dir / "best" / "meta.json").read_text())
        meta.pop("sha256")
        (run_dir / "best" / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["sample", "{run}", "--temperature", "-1"], "temperature must be >= 0"),
        (["sample", "{run}", "--top-k", "-2"], "top-k must be >= 0"),
        (["sample", "{run}", "--min-new-tokens", "-1"], "min-new-tokens must be >= 0"),
        (["sample", "{run}", "--top-p", "0"], "top-p must be in (0, 1]"),
        (["sample", "{run}", "--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["beam", "{run}", "-p", "x", "--beam-size", "0"], "beam-size must be >= 1"),
        (
            ["beam", "{run}", "-p", "x", "--beam-size", "2", "--nbest", "3"],
            "nbest must be between 1 and beam-size",
        ),
        (["sample", "{tmp}/missing"], "no such run or checkpoint folder"),
        (["beam", "{tmp}/missing", "-p", "x"], "no such run or checkpoint folder"),
        (["eval", "{tmp}/missing", "{tmp}/t.txt"], "no such run or checkpoint folder"),
        (["eval", "{run}", "{tmp}/empty.txt"], "empty"),
        (["eval", "{run}", "{tmp}/t.txt", "--stride", "0"], "stride must be >= 1"),
        (["eval", "{run}", "{tmp}/t.txt", "--stride", "99"], "stride must be between 1 and the context"),
        (["beam", "{run}", "-p", "x", "--reference", "{tmp}/t.txt"], "has 2 lines but there are 1 inputs"),
        (["export", "{run}", "{tmp}/x", "--format", "onnx"], "invalid format 'onnx'"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(tiny_run: Path, tmp_path: Path, capsys, argv, message) -> None:
    (tmp_path / "t.txt").write_text("the cat\nthe dog\n")
    (tmp_path / "empty.txt").write_text("")
    argv = [a.format(run=tiny_run, tmp=tmp_path) for a in argv]
    code, _, err = run(argv, capsys)
    assert_one_line_error(code, err, message)


@pytest.mark.parametrize(
    "how,message",
    [
        ("truncate", "is corrupt (checksum mismatch)"),
        ("truncate-unverified", "cannot read weights"),
        ("vocab", "has 18 tokens but the model expects 25"),
    ],
)
def test_broken_checkpoints_give_one_line(tiny_run: Path, capsys, how: str, message: str) -> None:
    _corrupt(tiny_run, how)
    code, _, err = run(["sample", str(tiny_run), "-p", "x"], capsys)
    assert_one_line_error(code, err, message)


def test_no_run_under_checkpoints(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["sample"], capsys)
    assert_one_line_error(code, err, "no run found under checkpoints/")


def test_a_padded_vocabulary_never_reaches_sample_beam_or_eval(tmp_path: Path, capsys) -> None:
    """A run whose 25-token vocabulary is padded to 64 rows, the padded rows of its (tied) head
    made huge: were they ever scored, greedy decoding would pick them. `sample` (the CPU fast
    step), `beam` and `eval` give exactly what a copy holding only the 25 real rows gives."""
    import torch

    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.formats.sources import load_checkpoint
    from lmcli.formats.weights import logical_state, model_from_state

    padded = make_run(tmp_path / "padded", vocab_multiple=64)
    ckpt = load_checkpoint(padded / "best")
    V = ckpt.model_config.vocab_size
    assert ckpt.model.wte.weight.shape[0] == 64 > V
    with torch.no_grad():
        ckpt.model.wte.weight[V:] = 50 * torch.randn(64 - V, ckpt.model.wte.weight.size(1))
    plain_cfg = dataclasses.replace(ckpt.model_config, vocab_multiple=1)
    plain = model_from_state(plain_cfg, logical_state(ckpt.model))
    for run_dir, model in ((padded, ckpt.model), (tmp_path / "plain", plain)):
        save_checkpoint(run_dir / "best", model, train_config(), ckpt.tokenizer, meta={"step": 0})
    (tmp_path / "t.txt").write_text("the cat sat on the mat.\nthe dog\n")
    commands = [
        ["sample", "-p", "the", "-p", "a", "--max-new-tokens", "12", "--temperature", "0", "--json"],
        ["sample", "-p", "the", "--max-new-tokens", "12", "--temperature", "1.5", "--seed", "3", "--json"],
        ["beam", "-i", str(tmp_path / "t.txt"), "--beam-size", "3", "--max-new-tokens", "8", "--json"],
        ["eval", str(tmp_path / "t.txt"), "--json"],
    ]
    for command in commands:
        outputs = []
        for run_dir in (padded, tmp_path / "plain"):
            code, out, err = run([command[0], str(run_dir / "best"), *command[1:]], capsys)
            assert code == 0, err
            outputs.append(without_speeds(out))
        assert outputs[0] == outputs[1], command


def without_speeds(jsonl: str) -> list:
    """JSON lines without the tokens/s figures ``sample --json`` records (they vary run to run)."""
    records = [json.loads(line) for line in jsonl.splitlines() if line.strip()]
    speeds = ("prefill_tokens_per_s", "decode_tokens_per_s")
    return [{k: v for k, v in r.items() if k not in speeds} if isinstance(r, dict) else r for r in records]
