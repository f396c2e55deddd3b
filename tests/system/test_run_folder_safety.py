"""Writing a run folder: never through a planted link, never shared by two writers, never lost.

Issue 20, items 1 (writer side), 4, 5, 6, 7, 13, 14 and 15. Each test failed before the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from helpers import (
    FAST_TRAIN_ARGS,
    TINY_TEXT,
    assert_one_line_error,
    assert_same_weights,
    read_metrics,
    run_cli,
    tiny_model,
    tiny_tokenizer,
    train_config,
    weights,
)

from lmcli.config.files import replace_options
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.sources import load_checkpoint
from lmcli.train import Reporter, train
from lmcli.train.metrics import MetricsLog, plot_loss_curve
from lmcli.train.run_folder import write_run_config

MODEL = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)


def config(tmp_path: Path, out: str | None, **kw) -> TrainConfig:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TINY_TEXT)
    base = dict(
        corpus=(str(corpus),),
        out=str(tmp_path / out) if out else None,
        batch_size=4,
        max_steps=6,
        eval_interval=2,
        log_interval=1,
        warmup_steps=1,
        eval_batches=1,
    )
    return train_config(**{**base, **kw})


def quiet(messages: list[str] | None = None, progress=None) -> Reporter:
    return Reporter(info=(messages.append if messages is not None else lambda m: None), progress=progress)


def cli_run(tmp_path: Path, name: str, capsys, *extra: str) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT)
    out = tmp_path / name
    code, _, err = run_cli(["train", str(corpus), "--out", str(out), *FAST_TRAIN_ARGS, *extra], capsys)
    assert code == 0, err
    return out


def snapshot(folder: Path) -> dict[str, tuple[bytes, int] | str]:
    """Every entry under ``folder``: a file's bytes and mtime, a link's target, a folder's mark."""
    snap: dict[str, tuple[bytes, int] | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            snap[key] = "link:" + os.readlink(path)
        elif path.is_dir():
            snap[key] = "dir"
        else:
            snap[key] = (path.read_bytes(), path.stat().st_mtime_ns)
    return snap


def outside_victims(tmp_path: Path) -> Path:
    """Files and folders outside any run folder that planted links point to."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "keep.txt").write_text("precious\n")
    (outside / "victim.sh").write_text("#!/bin/sh\necho hello\n")
    return outside


def plant(run: Path, outside: Path, names: list[str]) -> list[str]:
    """A symbolic link at each of ``names`` in ``run`` (that does not exist yet), pointing outside:
    a folder name to a folder, a file name to a file (its own, so a write through it shows)."""
    planted = []
    for name in names:
        link = run / name
        if os.path.lexists(link):
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target_for(outside, name))
        planted.append(name)
    return planted


def target_for(outside: Path, name: str) -> Path:
    """The victim a link at ``name`` points to, made once (so making it again changes nothing)."""
    if name in FOLDER_NAMES or name.startswith(".tmp-"):
        target = outside / f"dir-{name.strip('.').replace('/', '_')}"
        if not target.exists():
            target.mkdir()
            (target / "keep.txt").write_text("precious\n")
    else:
        target = outside / f"file-{name.strip('.').replace('/', '_')}"
        if not target.exists():
            target.write_text("precious\n")
    return target


FOLDER_NAMES = ["last", "best", "last.old", "best.old", "step-0000004", "step-0000004.old"]
# lmcli's temporary names before this fix, and every output name of a run folder
TEMP_NAMES = [".config.json.tmp", "metrics.jsonl.tmp", "loss.tmp.png"]
OUTPUT_NAMES = ["config.json", "metrics.jsonl", "loss.png", ".lock"]


def old_temp_folders() -> list[str]:
    return [f".tmp-{name}-{os.getpid()}" for name in ("last", "best", "step-0000004")]


# ----------------------------------------------------------------------------- item 1


def test_resuming_a_run_folder_that_holds_links_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    base = cli_run(tmp_path, "base", capsys, "--max-steps", "4")
    outside = outside_victims(tmp_path)
    for i, name in enumerate([*TEMP_NAMES, *OUTPUT_NAMES, "last.old", "best", "last/tokenizer.json"]):
        evil = tmp_path / f"evil{i}"
        shutil.copytree(base, evil, symlinks=True)
        if os.path.lexists(evil / name):
            shutil.rmtree(evil / name) if (evil / name).is_dir() else (evil / name).unlink()
        plant(evil, outside, [name])
        before = snapshot(outside)
        code, _, err = run_cli(["train", "--resume", str(evil), "--max-steps", "6"], capsys)
        assert_one_line_error(code, err, "symbolic link")
        assert name.split("/")[0] in err
        assert snapshot(outside) == before, f"a link at {name} was written through"


def test_writers_never_follow_a_planted_link(tmp_path: Path) -> None:
    """Even without the refusal at start (a link planted while a run writes), no writer follows one."""
    outside = outside_victims(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    plant(run, outside, [*TEMP_NAMES, "config.json", "loss.png", "last", "last.old", *old_temp_folders()])
    target_for(outside, "metrics.jsonl")
    before = snapshot(outside)
    write_run_config(run, MODEL, train_config())
    records = [{"step": 1, "train_loss": 3.0}, {"step": 2, "val_loss": 2.5}]
    log = MetricsLog(run / "metrics.jsonl")
    for r in records:
        log.append(r)
    log.truncate_after(1)
    plot_loss_curve(records, run / "loss.png")
    tok = tiny_tokenizer()
    save_checkpoint(run / "last", tiny_model(tok.vocab_size), train_config(), tok, meta={"step": 1})
    assert snapshot(outside) == before
    assert not (run / "config.json").is_symlink() and not (run / "last").is_symlink()
    load_checkpoint(run / "last")
    (run / "metrics.jsonl").unlink()
    plant(run, outside, ["metrics.jsonl"])
    with pytest.raises(LmcliError, match="symbolic link"):
        MetricsLog(run / "metrics.jsonl").append({"step": 3})
    assert snapshot(outside) == before


def test_planted_links_change_nothing_outside_the_run_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    """The security test: links at every temporary and output name, planted before a resume and
    while a new run tokenizes; train, resume, resume into a new folder and export; nothing outside
    the run folders changes (bytes and mtimes)."""
    base = cli_run(tmp_path, "base", capsys, "--max-steps", "4")
    outside = outside_victims(tmp_path)
    names = [*TEMP_NAMES, *OUTPUT_NAMES, *FOLDER_NAMES, *old_temp_folders()]
    extra = [f".tmp-fork2-{os.getpid()}", f".tmp-hf-{os.getpid()}"]
    for name in [*names, *extra]:
        target_for(outside, name)

    # a new run, links planted inside it while it reads its corpus
    import lmcli.train.setup as setup

    real_load = setup.load_train_data
    new = tmp_path / "new"

    def plant_then_load(*args, **kwargs):
        new.mkdir(exist_ok=True)
        plant(new, outside, names)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(setup, "load_train_data", plant_then_load)
    before = snapshot(outside)
    argv = ["train", str(tmp_path / "corpus.txt"), "--out", str(new), *FAST_TRAIN_ARGS, "--max-steps", "4"]
    code, _, err = run_cli([*argv, "--keep-last", "1"], capsys)
    if code:
        assert_one_line_error(code, err, "symbolic link")
    monkeypatch.setattr(setup, "load_train_data", real_load)
    assert snapshot(outside) == before

    # a resume of a run with links at every name, in place and into a new folder
    evil = tmp_path / "evil"
    shutil.copytree(base, evil)
    plant(evil, outside, names)
    before = snapshot(outside)
    for extra in ([], ["--out", str(tmp_path / "fork")]):
        code, _, err = run_cli(["train", "--resume", str(evil), "--max-steps", "6", *extra], capsys)
        assert_one_line_error(code, err, "symbolic link")
    assert snapshot(outside) == before

    # resume into a new folder, export: links at the old temporary names beside their outputs
    plant(tmp_path, outside, extra)
    before = snapshot(outside)
    code, _, err = run_cli(["train", "--resume", str(base), "--out", str(tmp_path / "fork2"), "-q"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["export", str(base), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    assert snapshot(outside) == before


# ----------------------------------------------------------------------------- item 4


class FrozenClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 1, 2, 3, 4, 5)


def start_another_run_while_tokenizing(monkeypatch, second) -> list:
    """Make the first ``load_train_data`` call start ``second()`` (a run started while the first
    one tokenizes, as from another shell); its result or error goes into the returned list."""
    import lmcli.train.setup as setup

    real_load = setup.load_train_data
    outcome: list = []

    def load(*args, **kwargs):
        if not outcome:
            outcome.append(None)
            try:
                outcome[0] = second()
            except LmcliError as exc:
                outcome[0] = exc
        return real_load(*args, **kwargs)

    monkeypatch.setattr(setup, "load_train_data", load)
    return outcome


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lmcli.train.run_folder.datetime", FrozenClock)
    cfg = config(tmp_path, None, max_steps=4)
    other = start_another_run_while_tokenizing(monkeypatch, lambda: train(MODEL, cfg, reporter=quiet()))
    first = train(MODEL, cfg, reporter=quiet(), progress=False)
    second = other[0]
    assert not isinstance(second, Exception), second
    assert first.run_dir != second.run_dir
    for result in (first, second):
        steps = [r["step"] for r in read_metrics(result.run_dir) if "train_loss" in r]
        assert steps == [1, 2, 3, 4], "one run's metrics only"
        assert json.loads((result.run_dir / "config.json").read_text())["train"]["out"].endswith(
            str(result.run_dir)
        )


def test_a_second_writer_of_a_run_folder_is_refused_naming_the_holder(tmp_path: Path, monkeypatch) -> None:
    cfg = config(tmp_path, "run", max_steps=4)
    # the same --out while the first run tokenizes
    other = start_another_run_while_tokenizing(
        monkeypatch, lambda: train(MODEL, cfg, reporter=quiet(), progress=False)
    )
    train(MODEL, cfg, reporter=quiet(), progress=False)
    assert isinstance(other[0], LmcliError), other[0]
    assert f"in use by another lmcli (pid {os.getpid()})" in str(other[0])
    # two resumes of one run at once
    longer = replace_options(cfg, max_steps=8)
    other = start_another_run_while_tokenizing(
        monkeypatch, lambda: train(MODEL, longer, resume=cfg.out, reporter=quiet(), progress=False)
    )
    train(MODEL, longer, resume=cfg.out, reporter=quiet(), progress=False)
    assert isinstance(other[0], LmcliError) and f"pid {os.getpid()}" in str(other[0])
    steps = [r["step"] for r in read_metrics(Path(cfg.out)) if "train_loss" in r]
    assert steps == list(range(1, 9)), "no duplicate steps"


# ----------------------------------------------------------------------------- item 5


def test_resume_into_another_folder_starts_a_new_run_and_leaves_the_old_one_untouched(
    tmp_path: Path, capsys
) -> None:
    full = train(MODEL, config(tmp_path, "full", max_steps=10), reporter=quiet(), progress=False)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(
            MODEL, config(tmp_path, "a", max_steps=10), reporter=quiet(progress=CrashAt(7, 0)), progress=False
        )
    a, b = tmp_path / "a", tmp_path / "b"
    assert load_checkpoint(a / "last").meta["step"] == 6
    before = snapshot(a)
    code, _, err = run_cli(["train", "--resume", str(a), "--out", str(b), "-q"], capsys)
    assert code == 0, err
    assert snapshot(a) == before, "the resumed run is untouched"
    assert load_checkpoint(b / "last").meta["step"] == 10
    assert_same_weights(weights(full.run_dir), weights(b))  # weights, optimizer, data position, RNGs
    assert [r for r in read_metrics(b) if r["step"] <= 6] == [r for r in read_metrics(a) if r["step"] <= 6]
    assert json.loads((b / "config.json").read_text())["train"]["out"] == str(b)
    assert load_checkpoint(b).path == b / "best"


# ----------------------------------------------------------------------------- item 6


def test_a_second_signal_during_the_stop_save_keeps_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """SIGINT at step 3 (no checkpoint yet), then another SIGINT while the stop path saves: the
    save completes, without a validation first, and the run folder stays."""
    import lmcli.formats.checkpoint as checkpoint

    real_save_file = checkpoint.save_file
    sent = []

    def save_file_interrupted(*args, **kwargs):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_file_interrupted)
    messages: list[str] = []
    cfg = config(tmp_path, "run", max_steps=50, eval_interval=100)
    try:
        result = train(MODEL, cfg, reporter=quiet(messages, SignalAt(3, 1)), progress=False)
    except KeyboardInterrupt:
        pytest.fail(f"the second signal cut the save short; run folder left: {(tmp_path / 'run').exists()}")
    assert sent and result.stopped == "SIGINT" and result.step == 3
    assert load_checkpoint(tmp_path / "run" / "last").meta["step"] == 3
    assert not [r for r in read_metrics(tmp_path / "run") if "val_loss" in r], "no validation first"
    assert any("kept" in m and "last (step 3)" in m for m in messages), messages


def test_a_second_signal_between_saves_stops_at_once_and_says_what_was_kept(tmp_path: Path) -> None:
    messages: list[str] = []
    cfg = config(tmp_path, "run", max_steps=50, eval_interval=4)
    with pytest.raises(KeyboardInterrupt):
        train(MODEL, cfg, reporter=quiet(messages, SignalAt(5, 2)), progress=False)
    assert load_checkpoint(tmp_path / "run" / "last").meta["step"] == 4
    assert any("interrupted at step 5" in m and "last (step 4)" in m for m in messages), messages


class SignalAt:
    """A progress reporter that sends itself ``count`` SIGINTs when the loop logs ``step``."""

    def __init__(self, step: int, count: int) -> None:
        self.step, self.count = step, count

    def start(self, total, step, max_time=None, shown=()) -> None:
        pass

    def update(self, step: int, record: dict) -> None:
        if step == self.step:
            for _ in range(self.count):
                os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> None:
        pass


# ----------------------------------------------------------------------------- item 7


class CrashAt(SignalAt):
    def update(self, step: int, record: dict) -> None:
        if step == self.step:
            raise RuntimeError("simulated crash")


@pytest.mark.slow
def test_save_interval_still_keeps_best_up_to_date(tmp_path: Path) -> None:
    cfg = config(tmp_path, "run", max_steps=40, eval_interval=2, save_interval=3, lr=3e-3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(MODEL, cfg, reporter=quiet(progress=CrashAt(13, 0)), progress=False)
    vals = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    best = min(vals, key=lambda r: r["val_loss"])
    ckpt = load_checkpoint(tmp_path / "run")  # what `lmcli eval RUN` scores
    assert ckpt.path.name == "best" and ckpt.meta["step"] == best["step"]
    assert ckpt.meta["val_loss"] == best["val_loss"]


# ----------------------------------------------------------------------------- item 13


@pytest.mark.slow
def test_stale_temporary_files_of_dead_writers_are_removed_at_the_next_start(tmp_path: Path, capsys) -> None:
    run = cli_run(tmp_path, "run", capsys, "--max-steps", "4")
    dead = subprocess.Popen(["true"])  # not reaped: a zombie, as killed workers whose parent died too
    while Path(f"/proc/{dead.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    stale = [
        f".last.{dead.pid}.k2j4h1.lmtmp",
        f".config.json.{dead.pid}.x8w2.lmtmp",
        f".tmp-last-{dead.pid}",  # the name lmcli 0.2 used
    ]
    for name in stale:
        (run / name).mkdir() if "last" in name else (run / name).write_text("{")
        if "last" in name:
            (run / name / "model.safetensors").write_bytes(os.urandom(1000))
    alive = run / ".best.1.a1b2.lmtmp"  # pid 1 runs: a writer that may still be writing
    alive.mkdir()
    code, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "6", "-q"], capsys)
    assert code == 0, err
    assert not [name for name in stale if os.path.lexists(run / name)]
    assert alive.exists()
    dead.wait()


# ----------------------------------------------------------------------------- item 14


@pytest.mark.slow
def test_keep_last_orders_step_folders_by_number(tmp_path: Path) -> None:
    """Past step 9,999,999 the names grow a digit: step-10000000 sorts before step-9999999 as text."""
    cfg = config(tmp_path, "run", max_steps=2)
    train(MODEL, cfg, reporter=quiet(), progress=False)
    last = tmp_path / "run" / "last"
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    state["step"] = 9_999_998
    torch.save(state, last / "trainer_state.pt")
    meta = json.loads((last / "meta.json").read_text())
    meta["step"] = 9_999_998
    meta.pop("sha256")
    (last / "meta.json").write_text(json.dumps(meta))
    longer = replace_options(cfg, max_steps=10_000_001, save_interval=1, keep_last=2, eval_interval=1000)
    train(MODEL, longer, resume=cfg.out, reporter=quiet(), progress=False)
    steps = sorted(p.name for p in (tmp_path / "run").glob("step-*"))
    assert steps == ["step-10000000", "step-10000001"]


# ----------------------------------------------------------------------------- item 15


def save_new_version(path: Path, step: int) -> None:
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size, seed=step, n_layer=1, n_embd=16, block_size=16)
    save_checkpoint(path, model, train_config(), tok, meta={"step": step}, state={"step": step})


@pytest.mark.parametrize("during", ["sha256_of", "read_tensors"])
def test_a_reader_sees_the_old_or_the_new_checkpoint_never_a_mix(tmp_path: Path, monkeypatch, during) -> None:
    """A writer replaces ``last`` while a reader is between reading meta.json and the weights
    (checksumming them, or loading them): the reader gets one whole checkpoint."""
    import lmcli.formats.checkpoint as checkpoint
    import lmcli.formats.weights as weights

    module = checkpoint if during == "sha256_of" else weights
    run = tmp_path / "run"
    save_new_version(run / "last", 1)
    real = getattr(module, during)
    swapped = []

    def read_while_a_writer_saves(*args, **kwargs):
        if not swapped:
            swapped.append(1)
            monkeypatch.setattr(module, during, real)
            save_new_version(run / "last", 2)
            monkeypatch.setattr(module, during, read_while_a_writer_saves)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, during, read_while_a_writer_saves)
    ckpt = load_checkpoint(run / "last", with_state=True)
    assert swapped
    assert ckpt.meta["step"] == ckpt.state["step"] == 2
    expected = tiny_model(ckpt.tokenizer.vocab_size, seed=2, n_layer=1, n_embd=16, block_size=16)
    assert_same_weights(ckpt.model.state_dict(), expected.state_dict())
