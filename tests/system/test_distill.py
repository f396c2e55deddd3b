"""`lmcli train --task distill`: a student's divergence from a trained teacher falls (online, and
from offline logits), the run records the teacher, its student exports; a run that crashes
resumes to the very weights of an uninterrupted one, on-policy samples included; a LoRA student,
a GGUF teacher run as stored, and a student cut from the teacher train; every bad input is one
line before training, leaving no run folder."""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    TINY_TEXT,
    CrashAt,
    assert_one_line_error,
    kill_after_checkpoint,
    make_run,
    read_metrics,
    run_cli,
    saved_step,
    train_config,
)
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))
from families import hf_folder  # noqa: E402

from lmcli.cli.app import main
from lmcli.config.model import ModelConfig
from lmcli.train import Reporter, train

QUIET = Reporter(info=lambda msg: None)
STUDENT = ("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16")
FAST = ("--batch-size", "4", "--warmup-steps", "2", "--threads", "1", "--eval-batches", "2", "-q")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus, a teacher trained on it (2 blocks, a byte tokenizer; its distributions far from
    uniform), its top-8 logits in chunks of 16 tokens (``tok``)."""
    tmp = tmp_path_factory.mktemp("distill")
    (tmp / "corpus.txt").write_text(TINY_TEXT * 3)
    teacher = [
        *("train", str(tmp / "corpus.txt"), "--n-layer", "2", "--n-head", "2", "--n-embd", "32"),
        *("--block-size", "32", "--max-steps", "60", "--lr", "3e-3", "--eval-interval", "60"),
        *("--tokenizer", "byte", "--out", str(tmp / "teacher"), "--cache-dir", str(tmp / "cache"), *FAST),
    ]
    logits = [
        *("tokenize", str(tmp / "corpus.txt"), "--teacher", str(tmp / "teacher"), "--top-k", "8"),
        *("--block-size", "16", "--threads", "1", "-o", str(tmp / "tok"), "-q"),
    ]
    for argv in (teacher, logits):
        try:
            main(argv)
        except SystemExit as done:
            assert not done.code
    return tmp


def distill_args(setup: Path, out: Path, *extra: str, corpus: str = "corpus.txt") -> list[str]:
    return [
        *("train", "--task", "distill", str(setup / corpus), "--teacher", str(setup / "teacher")),
        *("--out", str(out), "--cache-dir", str(setup / "cache"), *STUDENT, "--lr", "1e-2"),
        *("--max-steps", "40", "--eval-interval", "20", "--log-interval", "5", *FAST, *extra),
    ]


def kls(run: Path) -> list[float]:
    return [r["kl"] for r in read_metrics(run) if "kl" in r]


def test_the_divergence_from_the_teacher_falls_and_the_student_exports(
    setup: Path, tmp_path: Path, capsys
) -> None:
    code, _, err = run_cli(distill_args(setup, tmp_path / "run"), capsys)
    assert code == 0, err
    records = read_metrics(tmp_path / "run")
    trained = kls(tmp_path / "run")
    assert trained[-1] < 0.6 * trained[0]
    val = [r["val_kl"] for r in records if "val_kl" in r]
    assert len(val) == 2 and val[-1] < val[0] and (tmp_path / "run" / "loss.png").exists()
    assert all("ce" in r for r in records if "kl" in r)
    state = torch.load(tmp_path / "run" / "last" / "trainer_state.pt", weights_only=True)
    assert str(setup / "teacher") in state["teacher"]["identity"]  # the run records its teacher
    for fmt, out in (("hf", "hf"), ("gguf", "student.gguf")):
        code, _, err = run_cli(
            ["export", str(tmp_path / "run"), "--format", fmt, "-o", str(tmp_path / out)], capsys
        )
        assert code == 0, err
        code, _, err = run_cli(["eval", str(tmp_path / out), str(setup / "corpus.txt")], capsys)
        assert code == 0, err


def test_offline_logits_teach_as_the_teacher_does(setup: Path, tmp_path: Path, capsys) -> None:
    """The same student from the stored top-8 (no teacher in memory) and from the teacher run beside
    it: both divergences fall, to about the same point."""
    code, _, err = run_cli(distill_args(setup, tmp_path / "offline", corpus="tok"), capsys)
    assert code == 0, err
    offline = kls(tmp_path / "offline")
    assert offline[-1] < 0.6 * offline[0]
    assert not any("val_kl" in r for r in read_metrics(tmp_path / "offline"))  # no teacher loaded


def test_sampled_logits_teach_and_refuse_the_losses_they_cannot_estimate(
    setup: Path, tmp_path: Path, capsys
) -> None:
    """The student from 8 tokens drawn from the teacher at each position (no teacher in memory):
    the estimated divergence falls; the reverse KL and the JSD are refused before training."""
    tokens = tmp_path / "sampled"
    code, _, err = run_cli(
        [*("tokenize", str(setup / "corpus.txt"), "--teacher", str(setup / "teacher"), "--top-k", "8"),
         *("--logits", "sampled", "--block-size", "16", "--threads", "1", "-o", str(tokens))],
        capsys,
    )  # fmt: skip
    assert code == 0 and "teacher logits: 8 draws of every position in chunks of 16 tokens, 32 bytes" in err
    out = tmp_path / "run"
    for kind in ("reverse_kl", "jsd"):
        refused(
            capsys,
            [*distill_args(setup, out, corpus=str(tokens)), "--distill-loss", kind],
            f"--distill-loss {kind}: the teacher logits in {tokens} are tokens drawn from the teacher, "
            "which estimate only the forward KL",
            out,
        )
    code, _, err = run_cli(distill_args(setup, out, corpus=str(tokens)), capsys)
    assert code == 0, err
    trained = kls(out)
    assert trained[-1] < 0.6 * trained[0], trained


RESUMED = {
    "online-on-policy": dict(on_policy=0.5, on_policy_tokens=6, distill_loss="reverse_kl", dropout=0.1),
    "offline-on-policy-jsd": dict(corpus="tok", on_policy=0.25, distill_loss="jsd", distill_beta=0.3),
    "cut-alpha": dict(student_layers=1, distill_alpha=0.5, distill_temperature=2.0, n_embd=32),
}


@pytest.mark.parametrize("kind", list(RESUMED))
def test_resume_after_a_crash_equals_an_uninterrupted_run(setup: Path, tmp_path: Path, kind: str) -> None:
    options = dict(RESUMED[kind])
    dropout, width = options.pop("dropout", 0.0), options.pop("n_embd", 16)  # a cut student: the teacher's
    corpus = str(setup / options.pop("corpus", "corpus.txt"))
    common = dict(
        task="distill", corpus=(corpus,), teacher=str(setup / "teacher"), cache_dir=str(setup / "cache"),
        max_steps=12, eval_interval=4, eval_batches=1, log_interval=2, lr=3e-3, warmup_steps=2, seed=3,
        batch_size=4, threads=1, **options,
    )  # fmt: skip
    model = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=width, dropout=dropout)
    full = train(model, train_config(**common, out=str(tmp_path / "full")), reporter=QUIET, progress=False)
    cfg = train_config(**common, out=str(tmp_path / "crashed"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model, cfg, reporter=Reporter(info=lambda m: None, progress=CrashAt(6)), progress=False)
    resumed = train(model, cfg, resume=tmp_path / "crashed", reporter=QUIET, progress=False)
    assert resumed.step == full.step == 12
    a, b = (
        load_file(str(full.run_dir / "last" / "model.safetensors")),
        load_file(str(resumed.run_dir / "last" / "model.safetensors")),
    )
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    drop = ("elapsed", "tokens_per_s", "mfu")
    logs = [
        [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run) if "train_loss" in r]
        for run in (full.run_dir, resumed.run_dir)
    ]
    assert logs[0] == logs[1] and all("on_policy_kl" in r for r in logs[0]) == bool(options.get("on_policy"))


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(setup: Path, tmp_path: Path) -> None:
    """A real kill of an on-policy run at a random moment after a checkpoint, then ``--resume``:
    the weights of a run never interrupted, the student's samples included."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lmcli.cli.app", "lmcli.train.loop", "lmcli.train.display"])
    extra = ("--max-steps", "24", "--eval-interval", "4", "--on-policy", "0.5", "--on-policy-tokens", "6")

    def run(argv: list[str]) -> Any:
        process = ctx.Process(target=main, args=(argv,))
        process.start()
        return process

    full = run(distill_args(setup, tmp_path / "full", *extra))
    full.join(120)
    assert full.exitcode == 0
    killed = run(distill_args(setup, tmp_path / "killed", *extra))
    kill_after_checkpoint(killed, tmp_path / "killed", 8)
    assert killed.exitcode == -signal.SIGKILL and 8 <= saved_step(tmp_path / "killed") < 24
    resumed = run(["train", "--resume", str(tmp_path / "killed"), "--threads", "1", "-q"])
    resumed.join(120)
    assert resumed.exitcode == 0
    a = load_file(str(tmp_path / "full" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "last" / "model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_lora_student_a_gguf_teacher_and_a_cut_student_train(setup: Path, tmp_path: Path, capsys) -> None:
    make_run(tmp_path / "small", kind="byte", n_layer=1, n_embd=16, block_size=16)
    lora = ("--init-from", str(tmp_path / "small"), "--lora-rank", "2", "--max-steps", "6")
    code, _, err = run_cli(distill_args(setup, tmp_path / "lora", *lora), capsys)
    assert code == 0, err
    assert (tmp_path / "lora" / "last" / "adapters.safetensors").exists()
    # a LoRA run and a Hugging Face folder as teachers (their own tokenizers)
    folder = hf_folder(tmp_path, "llama-tied")
    for teacher in (tmp_path / "lora", folder):
        args = distill_args(setup, tmp_path / f"from-{teacher.name}", "--max-steps", "2")
        args[args.index(str(setup / "teacher"))] = str(teacher)
        code, _, err = run_cli(args, capsys)
        assert code == 0, err
    gguf = tmp_path / "teacher-q8.gguf"
    code, _, err = run_cli(
        ["export", str(setup / "teacher"), "--format", "gguf", "--dtype", "q8_0", "-o", str(gguf)], capsys
    )
    assert code == 0, err
    args = distill_args(setup, tmp_path / "from-gguf", "--max-steps", "20")
    args[args.index(str(setup / "teacher"))] = str(gguf)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert kls(tmp_path / "from-gguf")[-1] < kls(tmp_path / "from-gguf")[0]
    code, _, err = run_cli(
        distill_args(setup, tmp_path / "cut", "--student-layers", "1", "--max-steps", "6"), capsys
    )
    assert code == 0, err
    first = read_metrics(tmp_path / "cut")[0]
    scratch = read_metrics(tmp_path / "lora")[0]
    assert first["kl"] < scratch["kl"]  # the teacher's own embedding, block and head: near it at once


# ----------------------------------------------------------------------------- bad input


def refused(capsys, argv: list[str], message: str, out: Path) -> None:
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, message)
    assert not out.exists()


def test_bad_options_are_one_line(setup: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    plain = ["train", str(setup / "corpus.txt"), "--out", str(out)]
    refused(capsys, [*plain, "--teacher", str(setup / "teacher")], "--teacher needs --task distill", out)
    refused(capsys, [*plain, "--task", "distill"], "--task distill needs --teacher MODEL", out)
    base = distill_args(setup, out)
    refused(capsys, [*base, "--distill-beta", "0.2"], "--distill-beta weighs the teacher in jsd", out)
    refused(
        capsys,
        [*base, "--on-policy", "0.5", "--on-policy-tokens", "16"],
        "--on-policy-tokens 16 leaves no prompt",
        out,
    )
    refused(capsys, [*base, "--student-layers", "3"], "--student-layers 3: the teacher", out)
    both = [*base, "--student-layers", "1", "--init-from-teacher-layers", "0"]
    refused(capsys, both, "give --init-from-teacher-layers or --student-layers, not both", out)
    refused(
        capsys,
        [*base, "--on-policy-tokens", "4"],
        "--on-policy-tokens needs --on-policy FRACTION above 0",
        out,
    )
    masked = [*base, "--on-policy", "0.5", "--document-mask"]
    refused(capsys, masked, "--on-policy: the student's samples are not split into documents", out)
    refused(capsys, [*base, "--init-from-teacher-layers", "0,5"], "has blocks 0 to 1", out)
    refused(
        capsys,
        [*base, "--student-layers", "1", "--init-from", str(setup / "teacher")],
        "drop --init-from",
        out,
    )
    refused(
        capsys,
        [*base, "--block-size", "64"],
        "--block-size 64 is longer than the teacher's context (32 tokens)",
        out,
    )
    tokenize = ["tokenize", str(setup / "corpus.txt"), "-o", str(out)]
    refused(capsys, [*tokenize, "--top-k", "5"], "--top-k needs --teacher", out)
    refused(capsys, [*tokenize, "--logits", "sampled"], "--logits needs --teacher", out)
    teacher = ["--teacher", str(setup / "teacher")]
    vocabulary = "--top-k 1000 is more than the teacher's vocabulary (261 tokens)"
    refused(capsys, [*tokenize, *teacher, "--top-k", "1000", "--block-size", "16"], vocabulary, out)
    context = "--block-size 64 is longer than the teacher's context (32 tokens)"
    refused(capsys, [*tokenize, *teacher, "--block-size", "64"], context, out)
    refused(
        capsys,
        [*tokenize, *teacher, "--tokenizer", "byte"],
        "with --teacher the corpus is tokenized with the teacher's",
        out,
    )


def test_a_teacher_that_does_not_load_or_speaks_another_vocabulary_is_one_line(
    setup: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    args = distill_args(setup, out)
    teacher = args.index(str(setup / "teacher"))
    args[teacher] = str(tmp_path / "nothing")
    refused(capsys, args, f"--teacher {tmp_path / 'nothing'}: no such teacher model", out)
    broken = make_run(tmp_path / "broken", kind="byte")
    weights = broken / "best" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    args[teacher] = str(broken)
    refused(capsys, args, f"--teacher {broken} does not load", out)
    other = make_run(tmp_path / "other", text="entirely different letters: qrstuvw")
    student = [*distill_args(setup, out), "--init-from", str(other)]
    refused(capsys, student, f"the student (--init-from {other}) has another vocabulary (", out)
    args = distill_args(setup, out, corpus="tok")
    args[args.index(str(setup / "teacher"))] = str(other)
    refused(capsys, args, "was tokenized with another tokenizer than this run's", out)


def test_logits_of_another_teacher_or_settings_are_one_line(setup: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    twin = make_run(tmp_path / "twin", kind="byte", seed=5, n_layer=2, block_size=32)  # the same tokenizer
    args = distill_args(setup, out, corpus="tok")
    args[args.index(str(setup / "teacher"))] = str(twin)
    refused(capsys, args, f"the teacher logits in {setup / 'tok'} are of {setup / 'teacher'} (sha256", out)
    refused(capsys, [*distill_args(setup, out, corpus="tok"), "--distill-temperature", "2"],
            "are at temperature 1: give --distill-temperature 1", out)  # fmt: skip
    long = distill_args(setup, out, corpus="tok")
    long[long.index("--block-size") + 1] = "32"
    refused(capsys, long, "--block-size 32 is longer than the context the teacher logits", out)
    refused(capsys, [*distill_args(setup, out, corpus="tok"), "--align-documents"],
            "the windows start on their grid", out)  # fmt: skip


def test_a_resume_against_another_teacher_is_one_line(setup: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    code, _, err = run_cli(distill_args(setup, run, "--max-steps", "4", "--eval-interval", "4"), capsys)
    assert code == 0, err
    twin = make_run(tmp_path / "twin", kind="byte", seed=5, n_layer=2, block_size=32)
    code, _, err = run_cli(
        ["train", "--resume", str(run), "--max-steps", "6", "--teacher", str(twin), "-q"], capsys
    )
    assert_one_line_error(code, err, f"this run was distilled from {setup / 'teacher'} (sha256")
    assert "resume with the run's own teacher" in err and saved_step(run) == 4
    moved = tmp_path / "moved-teacher"  # the same teacher elsewhere: the same model
    shutil.copytree(setup / "teacher", moved)
    code, _, err = run_cli(
        ["train", "--resume", str(run), "--max-steps", "6", "--teacher", str(moved), "-q"], capsys
    )
    assert code == 0, err
