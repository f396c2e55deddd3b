"""The run's metrics log (``metrics.jsonl``), its loss-curve plot (``loss.png``) and, with
``--eval-task``, the plot of the downstream scores beside it (``tasks.png``).

Both are written through ``lmcli.safe_io``: appends never follow a link, rewrites go through an
exclusive temporary file and a rename.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from lmcli.safe_io import atomic_write, open_append


class MetricsLog:
    """Append-only JSONL of training and validation metrics, one object per line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        with open_append(self.path) as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut short by a crash
                continue
        return records

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (logged after the checkpoint a resume starts from)."""
        self.write([r for r in self.read() if r.get("step", 0) <= step])

    def write(self, records: list[dict[str, Any]]) -> None:
        """Replace the log with ``records`` (a resumed run's history up to its checkpoint)."""
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in records))


def _pyplot() -> Any:
    """matplotlib's pyplot drawing off-screen, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig: Any, plt: Any, out: Path) -> None:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    atomic_write(out, png.getvalue())


def plot_loss_curve(records: list[dict[str, Any]], out: Path) -> str | None:
    """Write train/validation loss against step to ``out`` (PNG); a reason string if impossible."""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install 'lmcli[plot]'), so no loss.png"
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        return "no metrics to plot"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), label="validation", marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, plt, out)
    return None


def plot_task_scores(records: list[dict[str, Any]], out: Path) -> bool:
    """Write each ``--eval-task`` score (``task:NAME:METRIC``, perplexities aside) against step
    to ``out`` (PNG), the loss plot's sibling; False when there are none (or no matplotlib)."""
    keys = sorted({k for r in records for k in r if k.startswith("task:") and not k.endswith(":perplexity")})
    plt = _pyplot() if keys else None
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(*zip(*points, strict=True), label=key.removeprefix("task:"), marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, plt, out)
    return True
