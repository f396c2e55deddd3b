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


Curve = tuple[list[tuple[int, float]], dict[str, Any]]  # (step, value) points, ``ax.plot`` options


def _plot(plt: Any, lines: list[Curve], ylabel: str, out: Path) -> None:
    """Curves against step (each its points and its ``ax.plot`` options) as a PNG at ``out``."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for points, style in lines:
        ax.plot(*zip(*points, strict=True), **style)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    atomic_write(out, png.getvalue())


def plot_loss_curve(records: list[dict[str, Any]], out: Path) -> str | None:
    """Write train/validation loss against step to ``out`` (PNG); a reason string if impossible.
    A dpo run's margin and a distill run's divergence from its teacher join its loss; a grpo run
    plots its reward instead."""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install 'lmcli[plot]'), so no loss.png"
    if any("reward" in r for r in records):  # --task grpo: the reward rises
        lines = _curves(records, "reward", "val_reward")
        _plot(plt, lines, "reward", out)
        return None
    # a distill run's loss is its divergence from the teacher: its text's cross-entropy (ce) is
    # what compares with the validation loss, and the divergence is drawn beside it
    train_key = "ce" if any("ce" in r for r in records) else "train_loss"
    lines = _curves(records, train_key, "val_loss")
    if not lines:
        return "no metrics to plot"
    for key, label in (("margin", "margin"), ("kl", "kl from the teacher")):  # dpo's margin, distill's kl
        if any(key in r for r in records):
            extra = _curves(records, key, f"val_{key}")
            for _, style in extra:
                style["label"] = f"{style['label']} {label}"
                style["linestyle"] = "--"
            _plot(plt, lines + extra, f"loss, {key} (nats)", out)
            return None
    _plot(plt, lines, "loss (nats/token)", out)
    return None


def _curves(records: list[dict[str, Any]], train_key: str, val_key: str) -> list[Curve]:
    """The training curve of ``train_key`` and the validation curve of ``val_key`` (those present)."""
    train = [(r["step"], r[train_key]) for r in records if train_key in r]
    val = [(r["step"], r[val_key]) for r in records if val_key in r]
    lines: list[Curve] = [(train, {"label": "train", "linewidth": 1})] if train else []
    return lines + ([(val, {"label": "validation", "marker": "o", "markersize": 3})] if val else [])


def plot_task_scores(records: list[dict[str, Any]], out: Path) -> bool:
    """Write each ``--eval-task`` score (``task:NAME:METRIC``, perplexities aside) against step
    to ``out`` (PNG), the loss plot's sibling; False when there are none (or no matplotlib)."""
    keys = sorted({k for r in records for k in r if k.startswith("task:") and not k.endswith(":perplexity")})
    plt = _pyplot() if keys else None
    if plt is None:
        return False
    lines = []
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        lines.append((points, {"label": key.removeprefix("task:"), "marker": "o", "markersize": 3}))
    _plot(plt, lines, "score", out)
    return True
