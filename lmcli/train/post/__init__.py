"""Post-training: the methods that tune a model that already speaks, each one object the training
loop asks as it asks any task's (``train.run.Method``), with its options in ``PostTrainConfig``.

- ``dpo.py``: ``DPO`` (``--task dpo``): preference pairs, ``score_preferences`` (``lmcli eval
  --preferences``); its losses, pure functions of log-probs: ``preference.py`` (DPO, IPO, SimPO);
- ``grpo.py``: ``GRPO`` (``--task grpo``): replies sampled and rewarded each step; its objective,
  pure: ``policy.py`` (group advantages, the clipped loss); ``rollouts.py`` (G replies a prompt
  from the row engine, seeded by the step); ``rewards.py`` (verifiers, ``--reward file.py:fn``
  run in a process of its own: ``reward_worker.py``);
- ``reference.py``: the model as training starts, as a method keeps it (the LoRA base, a frozen
  copy, a precomputed table);
- ``base.py``: ``PostMethod``, what the methods share (the reference, logged means, its memory);
- ``distill.py``: ``Distill`` (``--task distill``): a student learns a teacher's distributions,
  run beside it or read from logit shards (``teacher_logits.py`` writes them); its losses, pure:
  ``divergence.py``; the teacher: ``teacher.py``.

``open_method`` gives a run its method: the task's own (``OPENERS``, by task class), else
``NextToken``. A new method is a module here with a ``Method`` subclass and an ``open``, one line
in ``OPENERS``, and its task in ``lmcli/tasks.py`` (docs/post-training.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcli.config.train import TrainConfig
from lmcli.data.preferences import PromptData
from lmcli.data.train_data import TrainData
from lmcli.formats.checkpoint import Checkpoint
from lmcli.model.transformer import Transformer
from lmcli.tasks import Distillation, Preference, Reinforcement, Task, make_task
from lmcli.train.losses import NextToken
from lmcli.train.post.distill import Distill
from lmcli.train.post.dpo import DPO
from lmcli.train.post.grpo import GRPO
from lmcli.train.run import Method

Opener = Callable[[TrainConfig, Transformer, Checkpoint | None, TrainData | PromptData], Method[Any]]

OPENERS: dict[type[Task], Opener] = {
    Preference: DPO.open,
    Reinforcement: GRPO.open,
    Distillation: Distill.open,
}  # a task -> what opens its method (the others learn the next token: NextToken)


def open_method(
    cfg: TrainConfig, model: Transformer, resumed: Checkpoint | None, data: TrainData | PromptData
) -> Method[Any]:
    """The method of a run's task, opened with its model (the reference is taken from it),
    the checkpoint it resumes (None: a new run) and its data (a method checks its rows now)."""
    opener = OPENERS.get(type(make_task(cfg)))
    return opener(cfg, model, resumed, data) if opener is not None else NextToken(cfg)
