"""Downstream tasks scored during training (``--eval-task``): loaded once, scored at each
validation, and the scores a record shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcli.config.fields import TASK_SCORES
from lmcli.config.train import TrainConfig
from lmcli.device import autocast
from lmcli.errors import LmcliError
from lmcli.eval.downstream.formats import TaskFile
from lmcli.eval.downstream.kinds import KIND_OF

if TYPE_CHECKING:
    from lmcli.train.run import Run
from lmcli.eval.downstream.evaluate import chat_of, evaluate_tasks, load_tasks


def load_eval_tasks(cfg: TrainConfig) -> list[TaskFile]:
    """The run's ``--eval-task`` files, the first ``--eval-task-limit`` rows of each; a
    ``--select task:NAME:METRIC`` must name a score of that task's kind."""
    val = cfg.validation
    tasks = load_tasks(val.eval_task, val.eval_task_limit)
    select = cfg.selected_metric
    if select.startswith("task:"):
        _, name, metric = select.split(":")
        kind = KIND_OF[next(t.kind for t in tasks if t.name == name)]
        if metric not in kind.metrics:
            raise LmcliError(
                f"--select {select}: {name} is a {kind.name} task: "
                f"choose {' or '.join(m for m in kind.metrics if m in TASK_SCORES)}"
            )
    return tasks


def task_scores(run: Run) -> dict[str, float]:
    """Rank 0, at a validation: every ``--eval-task``'s scores as ``task:NAME:METRIC``."""
    if not run.eval_tasks:
        return {}
    model = run.model
    was_training = model.training
    model.eval()
    try:
        with autocast(run.device, run.amp):
            chat = chat_of(run.data.tokenizer, run.cfg)
            results = evaluate_tasks(model, run.data.tokenizer, run.eval_tasks, chat=chat)
    finally:
        model.train(was_training)
    return {f"task:{r.name}:{metric}": value for r in results for metric, value in r.scores.items()}


def describe_scores(record: dict[str, Any]) -> str:
    """The task scores of a metrics record, for the validation's line: ``, hs acc_norm 0.31``."""
    return "".join(
        f", {key.split(':')[1]} {key.split(':')[2]} {value:.3f}"
        for key, value in record.items()
        if key.startswith("task:")
    )
