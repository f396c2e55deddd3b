"""Rows of docs/bad-inputs.md not covered elsewhere: each gives its promised behaviour."""

from __future__ import annotations

from pathlib import Path

from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error, make_run, train_config
from helpers import run_cli as run

FAST = [*FAST_TRAIN_ARGS, "--max-steps", "2"]


def test_binary_only_corpus_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 10)
    code, _, err = run(["train", str(tmp_path / "img.png"), "--out", str(tmp_path / "run"), *FAST], capsys)
    assert_one_line_error(code, err, "corpus is empty")
    assert "looks like a binary file" in err and not (tmp_path / "run").exists()


def test_non_utf8_corpus_is_replaced_counted_and_trains(tmp_path: Path, capsys) -> None:
    (tmp_path / "latin1.txt").write_bytes(TINY_TEXT.encode() + "café crème\n".encode("latin-1") * 3)
    code, _, err = run(["train", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "run"), *FAST], capsys)
    assert code == 0 and "replaced 6 invalid UTF-8 sequence(s)" in err
    assert (tmp_path / "run" / "last" / "model.safetensors").exists()


def test_prompt_longer_than_the_context_keeps_its_end_with_a_warning(tmp_path: Path, capsys) -> None:
    run_dir = make_run(tmp_path / "run")
    code, out, err = run(["sample", str(run_dir), "-p", "the cat sat " * 20, "--max-new-tokens", "3"], capsys)
    assert code == 0 and "longer than the context were cut" in err
    code, out, err = run(["beam", str(run_dir), "-p", "the cat sat " * 20, "--max-new-tokens", "3"], capsys)
    assert code == 0 and len(out.splitlines()) == 1


def test_resume_with_another_model_shape_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    out = tmp_path / "run"
    assert run(["train", str(tmp_path / "c.txt"), "--out", str(out), *FAST], capsys)[0] == 0
    code, _, err = run(["train", "--resume", str(out), "--n-embd", "32"], capsys)
    assert_one_line_error(code, err, "cannot resume with a different model shape (n-embd 16 -> 32)")


def test_resume_with_another_rope_base_or_norm_eps_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    out = tmp_path / "run"
    assert (
        run(["train", str(tmp_path / "c.txt"), "--out", str(out), "--position", "rope", *FAST], capsys)[0]
        == 0
    )
    code, _, err = run(["train", "--resume", str(out), "--rope-base", "500"], capsys)
    assert_one_line_error(
        code, err, "cannot resume with a different model shape (rope-base 10000.0 -> 500.0)"
    )
    code, _, err = run(["train", "--resume", str(out), "--norm-eps", "1e-6"], capsys)
    assert_one_line_error(code, err, "cannot resume with a different model shape (norm-eps 1e-05 -> 1e-06)")


def test_resume_of_a_folder_without_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty_run").mkdir()
    code, _, err = run(["train", "--resume", str(tmp_path / "empty_run")], capsys)
    assert_one_line_error(code, err, "has no checkpoint to resume from")


def test_beam_without_any_input_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, err = run(["beam", str(make_run(tmp_path / "run"))], capsys, stdin="", monkeypatch=monkeypatch)
    assert_one_line_error(code, err, "no input")


def test_translation_run_needs_a_source_for_sample(tmp_path: Path, capsys, monkeypatch) -> None:
    from lmcli.formats.checkpoint import save_checkpoint
    from lmcli.formats.sources import load_checkpoint

    base = load_checkpoint(make_run(tmp_path / "lm"))
    save_checkpoint(
        tmp_path / "mt" / "last",
        base.model,
        train_config(task="translation", source="s", target="t"),
        base.tokenizer,
        meta={"step": 0},
    )
    code, _, err = run(["sample", str(tmp_path / "mt")], capsys, stdin="", monkeypatch=monkeypatch)
    assert_one_line_error(code, err, "this is a translation model: give the source text")


def test_unwritable_beam_output_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    code, _, err = run(
        [
            "beam",
            str(make_run(tmp_path / "run")),
            "-p",
            "the",
            "-o",
            str(tmp_path / "afile" / "o.txt"),
            "--max-new-tokens",
            "2",
        ],
        capsys,
    )
    assert_one_line_error(code, err, "Not a directory")


def test_parallel_ddp_or_fsdp_without_torchrun_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    for kind in ("ddp", "fsdp"):
        argv = ["train", str(tmp_path / "c.txt"), "--out", str(tmp_path / "run"), "--parallel", kind, *FAST]
        code, _, err = run(argv, capsys)
        assert_one_line_error(code, err, f"--parallel {kind} needs torchrun: torchrun --nproc_per_node=N")
        assert not (tmp_path / "run").exists()
