"""Where a run's metrics go: ``metrics.jsonl`` always, and the backends ``--log-to`` names
(TensorBoard, Weights & Biases), from rank 0 only.

A backend is a ``Tracker``: ``start(config, facts)`` once the run is open (its configuration and
the pre-flight facts), ``log(step, record)`` for every record the loop writes (whatever a
record holds: each number under its key, nested ones as ``outer/inner``), ``finish(results)``
at the end (the run's final results, also after a failure). TensorBoard writes event files to
``RUN/tensorboard`` through ``torch.utils.tensorboard``; W&B keeps its files where it always
does (``./wandb``, or ``$WANDB_DIR``: they hold symbolic links, which a run folder must not),
offline unless a key is set (``WANDB_MODE`` decides when it is set).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.safe_io import atomic_write
from lmcli.train.metrics import MetricsLog

# --log-to name -> (the module it needs, the extra that installs it)
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class Tracker:
    """A place a run's metrics go; every method does nothing unless a backend overrides it."""

    def start(self, config: dict[str, Any], facts: dict[str, Any]) -> None:
        """The run's configuration (``{"model": {...}, "train": {...}}``) and pre-flight facts."""

    def log(self, step: int, record: dict[str, Any]) -> None:
        """One record of the loop (training progress, a validation, ...) at ``step``."""

    def finish(self, results: dict[str, Any]) -> None:
        """The run's final results; nothing is logged after."""


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a record (``step`` aside), nested dicts flattened as ``outer/inner``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


def _table(rows: dict[str, Any]) -> str:
    """A Markdown table of ``rows`` (how TensorBoard shows text)."""
    lines = ["| | |", "|---|---|"]
    lines += [
        f"| {key} | {json.dumps(value) if not isinstance(value, str) else value} |"
        for key, value in rows.items()
    ]
    return "\n".join(lines)


class MetricsFile(Tracker):
    """``metrics.jsonl``: one JSON object per record, as every run folder has it."""

    def __init__(self, metrics: MetricsLog) -> None:
        self.metrics = metrics

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.metrics.append(record)


class TensorBoard(Tracker):
    """Event files in ``RUN/tensorboard``: every number as a scalar, the config, pre-flight facts
    and results as text. A run resumed in place hides what its earlier session logged after
    the checkpoint it resumes (``purge_step``)."""

    def __init__(self, run_dir: Path, resumed_at: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resumed_at + 1 if resumed_at is not None else None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def start(self, config: dict[str, Any], facts: dict[str, Any]) -> None:
        for section, options in config.items():
            self.writer.add_text(f"config/{section}", _table(options), 0)
        self.writer.add_text("preflight", _table(facts), 0)
        self.writer.flush()

    def log(self, step: int, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, step)

    def finish(self, results: dict[str, Any]) -> None:
        self.writer.add_text("results", _table(results), results.get("step", 0) or 0)
        self.writer.close()


def wandb_mode() -> str:
    """``WANDB_MODE`` when set; else online with an API key (the variable or ``wandb login``'s
    netrc entry), offline without one."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        import netrc

        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class WandB(Tracker):
    """A Weights & Biases run named after the run folder; a run resumed in place continues the
    same W&B run (its id is kept in ``RUN/wandb-run-id``). Online, when the service cannot be
    reached, it falls back to offline (``wandb sync`` uploads it later)."""

    def __init__(self, run_dir: Path) -> None:
        import wandb

        self.wandb, self.run_dir, self.run = wandb, run_dir, None
        id_file = run_dir / "wandb-run-id"
        known = id_file.read_text().strip() if id_file.is_file() and not id_file.is_symlink() else ""
        self.id = known if known.isalnum() else uuid.uuid4().hex[:12]
        atomic_write(id_file, self.id + "\n")

    def start(self, config: dict[str, Any], facts: dict[str, Any]) -> None:
        options = {
            "project": os.environ.get("WANDB_PROJECT", "lmcli"),
            "name": self.run_dir.name,
            "id": self.id,
            "resume": "allow",
            "config": {**config, "preflight": facts},
        }
        mode = wandb_mode()
        try:
            self.run = self.wandb.init(mode=mode, **options)
        except Exception as exc:  # wandb raises many types when the service cannot be reached
            if mode != "online":
                raise LmcliError(f"--log-to wandb: {str(exc).splitlines()[0][:200]}") from None
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            print(f"warning: W&B is unreachable ({reason}): logging offline", file=sys.stderr)
            self.run = self.wandb.init(mode="offline", **options)

    def log(self, step: int, record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log(scalars(record), step=step)

    def finish(self, results: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(results)
            self.run.finish(exit_code=0 if results.get("stopped") != "error" else 1)
            self.run = None


class Trackers(Tracker):
    """Every backend of a run (none on ranks but 0), called in turn; ``finish`` once."""

    def __init__(self, backends: list[Tracker]) -> None:
        self.backends = backends
        self.finished = False

    def start(self, config: dict[str, Any], facts: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.start(config, facts)

    def log(self, step: int, record: dict[str, Any]) -> None:
        for backend in self.backends:
            backend.log(step, record)

    def finish(self, results: dict[str, Any]) -> None:
        if self.finished:
            return
        self.finished = True
        for backend in self.backends:
            backend.finish(results)


def require_backends(names: tuple[str, ...]) -> None:
    """One line naming what to install when a ``--log-to`` backend's package is absent."""
    for name in names:
        module, extra = NEEDS[name]
        if importlib.util.find_spec(module) is None:
            raise LmcliError(f"--log-to {name} needs the {module} package: pip install 'lmcli[{extra}]'")


def open_trackers(
    names: tuple[str, ...], metrics: MetricsLog, run_dir: Path, resumed_at: int | None, is_main: bool
) -> Trackers:
    """The run's trackers: metrics.jsonl and the ``--log-to`` backends, on rank 0 (``resumed_at``:
    the step a run resumed in place restarts from)."""
    if not is_main:
        return Trackers([])
    backends: list[Tracker] = [MetricsFile(metrics)]
    for name in names:
        backends.append(TensorBoard(run_dir, resumed_at) if name == "tensorboard" else WandB(run_dir))
    return Trackers(backends)
