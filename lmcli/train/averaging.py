"""Weight averaging: an exponential moving average kept during training (``--ema``), and the
average of a run's last N saved checkpoints (``lmcli average``).

The EMA is ``torch.optim.swa_utils.AveragedModel`` with a decay that warms up as
min(decay, (1 + n) / (10 + n)) after n updates, so a short run's average is not dominated by
its first weights. Its state (the averaged weights and n) is saved with the trainer state, so a
resumed run continues it bit for bit; its weights are also written as the ``ema/`` checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel

from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import STEP, Checkpoint, save_checkpoint, step_checkpoints
from lmcli.formats.sources import load_checkpoint
from lmcli.formats.weights import model_from_state, model_state
from lmcli.model.transformer import Transformer


class EMA:
    """An exponential moving average of a model's parameters; ``module`` is the averaged model.

    A training run's weight average: ``update`` after each optimizer step, validated as
    ``val_loss_<name>``, its weights saved as the checkpoint folder ``<name>/`` (with ``meta``),
    its state (``state_dict``) in ``trainer_state.pt`` under ``<name>``."""

    name = "ema"  # its checkpoint folder and its key in trainer_state.pt and metrics.jsonl
    label = "EMA"  # how messages name it

    def __init__(self, model: Transformer, decay: float) -> None:
        self.decay = decay
        self.averaged = AveragedModel(model, multi_avg_fn=self._average, use_buffers=False)
        self.val_loss: float | None = None  # the last validation loss of the averaged weights

    def _average(self, averaged: list[torch.Tensor], current: list[torch.Tensor], n: Any) -> None:
        d = min(self.decay, (1.0 + float(n)) / (10.0 + float(n)))
        torch._foreach_lerp_(averaged, current, 1.0 - d)  # averaged = d * averaged + (1 - d) * current

    @property
    def module(self) -> Transformer:
        return self.averaged.module

    def start_from(self, model: torch.nn.Module) -> None:
        """The average's weights set to ``model``'s (after both were placed on the device, or
        sharded alike: each process copies its own rows)."""
        with torch.no_grad():
            for mine, theirs in zip(self.module.parameters(), model.parameters(), strict=True):
                mine.copy_(theirs)

    def update(self, model: torch.nn.Module) -> None:
        """Fold the model's current parameters into the average (after an optimizer step)."""
        with torch.no_grad():
            self.averaged.update_parameters(model)

    def meta(self) -> dict[str, Any]:
        """What its checkpoint's meta.json says besides the run's step."""
        return {"val_loss": self.val_loss, "ema_decay": self.decay}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.averaged.load_state_dict(state)


def finite_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint's weights; one line when one holds a NaN or an infinity (an average of it
    would be NaN too, silently)."""
    state = model_state(ckpt.model)
    for name, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise LmcliError(f"{ckpt.path} holds NaN or infinite weights ({name}): cannot average it")
    return state


def average_checkpoints(run_dir: str | Path, last: int, out: str | Path | None = None) -> Path:
    """Average the parameters of ``run_dir``'s ``last`` newest ``step-N`` checkpoints (saved with
    ``--keep-last`` and ``--save-interval``) into a new checkpoint folder; returns its path.

    Every checkpoint must have the same model config; the average is computed in float64 and
    stored in each tensor's own dtype. The default output is ``RUN/average-last-N``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise LmcliError(f"no such run folder: {run_dir}")
    linked = sorted(p for p in run_dir.iterdir() if STEP.fullmatch(p.name) and p.is_symlink())
    if linked:
        raise LmcliError(f"{linked[0]} is a symbolic link: a run folder must not contain links")
    found = step_checkpoints(run_dir)
    if last < 1:
        raise LmcliError(f"--last must be at least 1, got {last}")
    if len(found) < last:
        raise LmcliError(
            f"{run_dir} has {len(found)} step-N checkpoint(s), --last {last} asks for more "
            "(train with --keep-last N and --save-interval K to keep them)"
        )
    chosen = found[-last:]
    dest = Path(out) if out is not None else run_dir / f"average-last-{last}"
    if dest.exists():
        raise LmcliError(f"{dest} already exists: choose another --out")
    first = load_checkpoint(chosen[0])
    sums = {k: v.double().clone() for k, v in finite_state(first).items()}
    ckpt = first
    for path in chosen[1:]:
        ckpt = load_checkpoint(path)
        if ckpt.model_config != first.model_config:
            raise LmcliError(f"{path} has another model config than {chosen[0]}: cannot average them")
        if ckpt.tokenizer.fingerprint != first.tokenizer.fingerprint:
            raise LmcliError(f"{path} has another tokenizer than {chosen[0]}: cannot average them")
        for k, v in finite_state(ckpt).items():
            sums[k] += v.double()
    reference = model_state(first.model)
    state = {k: (v / last).to(reference[k].dtype) for k, v in sums.items()}
    model = model_from_state(first.model_config, state)
    meta = {"step": ckpt.meta.get("step"), "averaged": [p.name for p in chosen]}
    save_checkpoint(dest, model, first.train_config, first.tokenizer, meta=meta)
    return dest
