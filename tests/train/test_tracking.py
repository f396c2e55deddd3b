"""Tracking: metrics.jsonl beside TensorBoard (read back by TensorBoard's own reader) and W&B
(offline without a key), from rank 0, with the config, pre-flight facts and final results."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
from helpers import FAST_TRAIN_ARGS, TINY_TEXT, assert_one_line_error, read_metrics, run_cli

from lmcli.train.tracking import TensorBoard, scalars, wandb_mode

STEPS = ["--max-steps", "4", "--log-interval", "2", "--eval-interval", "2"]


def train(tmp_path: Path, capsys, *flags: str, out: str = "run") -> Path:
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    run = tmp_path / out
    code, _, err = run_cli(
        ["train", str(tmp_path / "c.txt"), *FAST_TRAIN_ARGS, *STEPS, "--out", str(run), *flags], capsys
    )
    assert code == 0, err
    return run


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_metric_the_config_and_the_results(tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(tmp_path, capsys, "--log-to", "tensorboard")
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    metrics = read_metrics(run)
    for key in ("train_loss", "lr", "grad_norm", "val_loss"):
        logged = [(r["step"], r[key]) for r in metrics if key in r]
        read = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in read] == [s for s, _ in logged] == [2, 4]
        assert [v for _, v in read] == pytest.approx([v for _, v in logged], rel=1e-6)  # float32
    texts = events.Tags()["tensors"]
    for tag in ("config/model", "config/train", "preflight", "results"):
        assert f"{tag}/text_summary" in texts
    results = events.Tensors("results/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| stopped | max_steps |" in results and "best_val_loss" in results


def test_whatever_a_record_holds_is_logged_as_a_number(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert scalars({"step": 3, "val_loss": 2.5, "eval": {"hellaswag": 0.25}, "note": "x", "ok": True}) == {
        "val_loss": 2.5,
        "eval/hellaswag": 0.25,
    }
    board = TensorBoard(tmp_path, None)
    board.start({"train": {"lr": 0.1}}, {"parameters": "1k"})
    board.log(3, {"step": 3, "eval": {"hellaswag": 0.25, "arc_easy": 0.5}})
    board.finish({"step": 3, "stopped": "max_steps"})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/arc_easy")] == [(3, 0.5)]


class FakeWandb(types.ModuleType):
    """What lmcli asks of the wandb package, recorded."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.summary: dict = {}
        self.exit_codes: list[int] = []

    def init(self, **options):
        self.inits.append(options)
        fake = self

        class Run:
            summary = fake.summary

            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self, exit_code):
                fake.exit_codes.append(exit_code)

        return Run()


def test_wandb_gets_the_config_every_record_and_the_results_offline_without_a_key(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    run = train(tmp_path, capsys, "--log-to", "wandb")
    (init,) = fake.inits
    assert init["mode"] == "offline" and init["name"] == "run" and init["resume"] == "allow"
    assert init["config"]["model"]["n_layer"] == 1 and init["config"]["train"]["max_steps"] == 4
    assert "parameters" in init["config"]["preflight"]
    assert [step for step, _ in fake.logged] == [2, 2, 4, 4]  # progress and validation at each
    assert fake.summary["stopped"] == "max_steps" and fake.summary["step"] == 4 and fake.exit_codes == [0]
    assert init["id"] == (run / "wandb-run-id").read_text().strip()
    code, _, err = run_cli(["train", "--resume", str(run), "--max-steps", "6", "-q"], capsys)
    assert code == 0, err
    assert fake.inits[1]["id"] == init["id"]  # a run resumed in place continues its W&B run


def test_wandb_mode_follows_the_variable_then_the_key(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--log-to", "tensorboard"],
            "--log-to tensorboard needs the tensorboard package: pip install 'lmcli[tensorboard]'",
        ),
        (["--log-to", "mlflow"], "invalid log-to 'mlflow': choose from tensorboard, wandb"),
    ],
    ids=["not-installed", "unknown"],
)
def test_a_tracker_that_cannot_be_used_is_one_line(
    tmp_path: Path, capsys, monkeypatch, flags, message
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    code, _, err = run_cli(
        ["train", str(tmp_path / "c.txt"), *FAST_TRAIN_ARGS, "--out", str(tmp_path / "r"), *flags], capsys
    )
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "r").exists()
