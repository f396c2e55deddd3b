"""Scoring task files: ``lmcli eval RUN --task FILE`` and ``--eval-task`` at each validation.

``evaluate_tasks`` scores the rows of each task with its kind and reports one ``TaskResult`` per
task; ``combined`` is the mean of each task's main score (``acc_norm`` of multiple choice,
``acc`` of cloze, ``exact_match`` of generation). During training, ``load_eval_tasks`` reads the
``--eval-task`` files once, when the run opens (a bad file stops it before the first step), and
``task_scores`` scores them at every validation, as ``task:NAME:METRIC`` keys of the metrics
record.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.eval.downstream.formats import TaskFile, read_task
from lmcli.eval.downstream.kinds import KIND_OF, Chat, Scorer
from lmcli.model.transformer import Transformer
from lmcli.tasks import make_task
from lmcli.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    pass


@dataclass
class TaskResult:
    """One task's scores over its rows."""

    name: str
    kind: str  # multiple_choice, cloze, generation, or harness (an lm-evaluation-harness task)
    rows: int
    fewshot: int
    scores: dict[str, float]
    main: str | None  # the metric the combined score reads (None: none of the task's)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rows": self.rows, "fewshot": self.fewshot, **self.scores}


def load_tasks(paths: tuple[str, ...], limit: int | None = None, num_fewshot: int = 0) -> list[TaskFile]:
    """The task files, read and checked; two files of one name are refused."""
    tasks = [read_task(path, limit, num_fewshot) for path in paths]
    names = [t.name for t in tasks]
    for name in names:
        if names.count(name) > 1:
            raise LmcliError(f"two task files are named {name}: rename one")
    return tasks


def chat_of(tokenizer: Tokenizer, train_config: TrainConfig, folder: str | Path | None = None) -> Chat | None:
    """How a model answers generation tasks: in its chat template's turns when it has one (its
    folder's Hugging Face template; lmcli's for a model fine-tuned on conversations), else None."""
    from lmcli.text.chat_template import find_template

    template = find_template(folder) if folder is not None else tokenizer.chat_template
    if template is not None:
        return Chat(template)
    return Chat(None) if make_task(train_config).examples == "conversations" else None


def evaluate_tasks(
    model: Transformer,
    tokenizer: Tokenizer,
    tasks: list[TaskFile],
    *,
    batch_size: int = 8,
    chat: Chat | None = None,
    max_gen_tokens: int = 256,
    progress: bool = False,
) -> list[TaskResult]:
    """Score every row of every task (the model in eval mode, as given)."""
    bar = _bar(sum(len(t.items) for t in tasks)) if progress else None
    scorer = Scorer(model, tokenizer, batch_size, chat, max_gen_tokens)
    if bar is not None:
        scorer.advance = bar.update
    results = []
    try:
        for task in tasks:
            kind = KIND_OF[task.kind]
            if bar is not None:
                bar.set_description(task.name)
            rows = kind.score(scorer, task.items, task.shots)
            scores = kind.aggregate(rows)
            results.append(TaskResult(task.name, task.kind, len(rows), len(task.shots), scores, kind.main))
    finally:
        if bar is not None:
            bar.close()
    return results


def combined(results: list[TaskResult]) -> float:
    """The mean of each task's main score (acc_norm, acc or exact_match)."""
    mains = [r.scores[r.main] for r in results if r.main is not None]
    return sum(mains) / len(mains) if mains else float("nan")


def report(results: list[TaskResult]) -> dict[str, Any]:
    """``--json``'s object: every task file's scores, every harness task's, the combined score."""
    return {
        "tasks": {r.name: r.to_dict() for r in results if r.kind != "harness"},
        "harness": {r.name: r.to_dict() for r in results if r.kind == "harness"},
        "combined": combined(results),
    }


def _bar(total: int):  # noqa: ANN202 - a tqdm bar
    from tqdm import tqdm

    return tqdm(total=total, unit="row", file=sys.stderr, leave=False, disable=None)


# ----------------------------------------------------------------------------- during training
