"""Nothing a user did may be lost: kills, signals, crashes mid-save, planted pickles, NaNs, full disks."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_TEXT,
    assert_same_weights,
    read_metrics,
    run_cli,
    tiny_model,
    tiny_tokenizer,
    train_config,
    weights,
)

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.sources import load_checkpoint
from lmcli.train import Reporter, train

ARGS = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--batch-size",
    "8",
    "--eval-interval",
    "5",
    "--eval-batches",
    "1",
    "--warmup-steps",
    "5",
    "--lr",
    "0.003",
    "--dropout",
    "0.1",
    "-q",
]


def lmcli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "lmcli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(run: Path, at_least: int, proc: subprocess.Popen, timeout: float = 60.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        meta = run / "last" / "meta.json"
        if meta.exists():
            try:
                step = json.loads(meta.read_text())["step"]
            except (ValueError, KeyError):
                step = -1
            if step >= at_least:
                return step
        if proc.poll() is not None:
            raise AssertionError(f"training ended early: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("no checkpoint in time")


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TINY_TEXT * 3)
    steps = ["--max-steps", "200"]
    full = lmcli("train", str(corpus), "--out", str(tmp_path / "full"), *ARGS, *steps)
    assert full.wait(120) == 0, full.stderr.read()
    killed = lmcli("train", str(corpus), "--out", str(tmp_path / "killed"), *ARGS, *steps)
    seen = wait_for_step(tmp_path / "killed", 5 * int(1 + time.time() % 10), killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert killed.returncode == -signal.SIGKILL
    step = json.loads((tmp_path / "killed" / "last" / "meta.json").read_text())["step"]
    assert seen <= step < 200, "killed before the end"
    resumed = lmcli("train", "--resume", str(tmp_path / "killed"), "-q")
    assert resumed.wait(120) == 0, resumed.stderr.read()
    assert_same_weights(weights(tmp_path / "full"), weights(tmp_path / "killed"))


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_save_print_the_resume_command_and_exit(tmp_path: Path, sig: int, code: int) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TINY_TEXT * 3)
    proc = lmcli("train", str(corpus), "--out", str(tmp_path / "run"), *ARGS, "--max-steps", "100000")
    wait_for_step(tmp_path / "run", 5, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"lmcli train --resume {tmp_path / 'run'}" in err
    # the checkpoint holds the step the run stopped at (the signal may land before step 6 starts)
    stopped_at = int(re.search(r"stopped by SIG\w+ at step (\d+)", err).group(1))
    assert stopped_at >= 5
    assert load_checkpoint(tmp_path / "run" / "last").meta["step"] == stopped_at


def tiny_checkpoint(path: Path) -> None:
    """A checkpoint folder at ``path``; unseeded, so each call writes other weights."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, seed=None, block_size=16, n_layer=1, n_embd=16)
    save_checkpoint(path, model, train_config(), tok, meta={"step": 1}, state={"step": 1})


def test_a_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    tiny_checkpoint(tmp_path / "last")
    before = (tmp_path / "last" / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # killed while writing the weights

    monkeypatch.setattr("lmcli.formats.checkpoint.save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        tiny_checkpoint(tmp_path / "last")
    assert (tmp_path / "last" / "model.safetensors").read_bytes() == before
    assert not list(tmp_path.glob(".*lmtmp")), "the temporary folder is cleaned up"
    load_checkpoint(tmp_path / "last")


def test_a_crash_between_the_two_renames_is_recovered(tmp_path: Path, monkeypatch) -> None:
    """The old checkpoint moved aside, the new one not yet in place: loading uses last.old."""
    run = tmp_path / "run"
    tiny_checkpoint(run / "last")
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the second rename: new checkpoint into place
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr("lmcli.formats.checkpoint.os.replace", replace)
    with pytest.raises(KeyboardInterrupt):
        tiny_checkpoint(run / "last")
    monkeypatch.undo()
    assert not (run / "last").exists() and (run / "last.old").exists()
    assert load_checkpoint(run).path.name == "last.old"


def test_full_disk_during_a_save_is_one_line_and_keeps_the_old_checkpoint(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    out = tmp_path / "run"
    assert (
        run_cli(["train", str(tmp_path / "c.txt"), "--out", str(out), *ARGS, "--max-steps", "5"], capsys)[0]
        == 0
    )
    before = (out / "last" / "model.safetensors").read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("lmcli.formats.checkpoint.save_file", full)
    code, _, err = run_cli(["train", "--resume", str(out), "--max-steps", "10", "-q"], capsys)
    assert code == 2 and err.strip().splitlines()[-1] == "error: No space left on device"
    assert (out / "last" / "model.safetensors").read_bytes() == before
    assert not list(out.glob(".*lmtmp"))


class Boom:
    """Unpickling this would create a marker file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_refused_never_executed(tmp_path: Path) -> None:
    tiny_checkpoint(tmp_path / "last")
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "evil": Boom(str(marker))}, tmp_path / "last" / "trainer_state.pt")
    meta = json.loads((tmp_path / "last" / "meta.json").read_text())
    meta.pop("sha256")  # even without checksums to catch the change
    (tmp_path / "last" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LmcliError, match="cannot read trainer state"):
        load_checkpoint(tmp_path / "last", with_state=True)
    torch.save({"wte.weight": Boom(str(marker))}, tmp_path / "last" / "model.safetensors")
    with pytest.raises(LmcliError, match="cannot read weights"):
        load_checkpoint(tmp_path / "last")
    assert not marker.exists()


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    cfg = train_config(
        corpus=(str(tmp_path / "c.txt"),),
        out=str(tmp_path / "run"),
        batch_size=4,
        max_steps=40,
        eval_interval=10,
        log_interval=5,
        eval_batches=1,
    )
    model = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    real_ce = torch.nn.functional.cross_entropy
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real_ce(*args, **kwargs)
        return loss * float("nan") if calls["n"] > 14 else loss  # training steps 1-14 and evals are fine

    monkeypatch.setattr("lmcli.train.losses.F.cross_entropy", poisoned)
    with pytest.raises(LmcliError, match=r"loss became nan at or before step 15"):
        train(model, cfg, reporter=Reporter(info=lambda m: None), progress=False)
    good = load_checkpoint(tmp_path / "run" / "last")
    assert good.meta["step"] == 10
    assert all(torch.isfinite(p).all() for p in good.model.parameters())
    assert all("grad_norm" in r for r in read_metrics(tmp_path / "run") if "train_loss" in r)


def test_a_nan_between_log_points_never_reaches_a_saved_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """Validation (and its save) at step 8 falls between log points 0 and 10: the NaN of step 7
    must stop the run there, not overwrite the good checkpoint of step 4."""
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    cfg = train_config(
        corpus=(str(tmp_path / "c.txt"),),
        out=str(tmp_path / "run"),
        batch_size=4,
        max_steps=40,
        eval_interval=4,
        log_interval=10,
        eval_batches=1,
    )
    real_ce = torch.nn.functional.cross_entropy
    calls = {"train": 0}

    def poisoned(*args, **kwargs):
        loss = real_ce(*args, **kwargs)
        if torch.is_grad_enabled():  # a training step, not a validation
            calls["train"] += 1
            if calls["train"] >= 7:
                return loss * float("nan")
        return loss

    monkeypatch.setattr("lmcli.train.losses.F.cross_entropy", poisoned)
    model = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(LmcliError, match=r"loss became nan at or before step 8"):
        train(model, cfg, reporter=Reporter(info=lambda m: None), progress=False)
    good = load_checkpoint(tmp_path / "run" / "last")
    assert good.meta["step"] == 4
    assert all(torch.isfinite(p).all() for p in good.model.parameters())
