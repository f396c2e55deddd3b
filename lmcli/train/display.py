"""Terminal presentation with rich: the pre-flight table and the training progress bar."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmcli.train.preflight import Preflight, fmt_duration, fmt_rate, preflight_rows
from lmcli.train.run import Reporter


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


class TrainProgress:
    """A rich progress bar: step, loss, lr, tokens/s and ETA, refreshed at log points."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.task: Any = None
        self.max_time: float | None = None
        self.shown: tuple[tuple[str, str, str], ...] = ()

    def start(
        self,
        total: int | None,
        step: int,
        max_time: float | None = None,
        shown: tuple[tuple[str, str, str], ...] = (),
    ) -> None:
        """Start at ``step`` of ``total``; ``shown``: the method's logged fields the bar shows
        (``Method.shown``: field, label, format)."""
        self.max_time, self.shown = max_time, shown
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=step, stats="", eta="?")

    def update(self, step: int, record: dict[str, Any]) -> None:
        if self.progress is None:
            return
        total = self.progress.tasks[0].total
        tok_s = record["tokens_per_s"]
        stats = f"loss {record['train_loss']:.4f}  lr {record['lr']:.2e}  {fmt_rate(tok_s)} tok/s"
        for field, label, fmt in self.shown:  # the method's: dpo's margin, grpo's reward, distill's KL
            if record.get(field) is not None:
                stats += f"  {label} {record[field]:{fmt}}"
        if record.get("mfu") is not None:
            stats += f"  MFU {100 * record['mfu']:.1f}%"
        remaining = []
        if total and step:
            remaining.append(record["elapsed"] / step * (total - step))
        if self.max_time is not None:
            remaining.append(max(self.max_time - record["elapsed"], 0.0))
        eta = fmt_duration(min(remaining)) if remaining else "?"
        self.progress.update(self.task, completed=step, stats=stats, eta=eta)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def rich_reporter(quiet: bool = False) -> Reporter:
    """A Reporter printing to stderr with rich (quiet: only warnings and the final line)."""
    console = stderr_console()

    def info(msg: str) -> None:
        if not quiet or msg.startswith(("warning", "done", "stopped", "time limit", "interrupted")):
            console.print(msg, markup=False, soft_wrap=True)

    def preflight(p: Preflight, facts: dict[str, str]) -> None:
        if quiet:
            return
        table = Table(title="lmcli train: pre-flight", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for label, value in preflight_rows(p, facts.pop("device", ""), facts):
            if value:
                table.add_row(label, value)
        console.print(table)

    return Reporter(info=info, preflight=preflight, progress=None if quiet else TrainProgress(console))
