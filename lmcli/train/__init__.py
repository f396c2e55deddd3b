"""Training: the loop and everything a run needs around it.

- ``loop.py``: ``train``: the loop (step, log, validate, save) and its pieces;
- ``setup.py``: a run opened (options, folder, data, model placed, state restored, pre-flight);
- ``run.py``: what a run holds (``Run``), ``Reporter``, ``TrainResult``; ``signals.py``: stops;
- ``parallel.py``, ``sharded.py``, ``distributed.py``: DDP/FSDP2, sharded checkpoints, torchrun;
- ``task_scores.py``: downstream tasks scored at each validation (``--eval-task``);
- ``state.py``: ``TrainState`` (step, data cursor, best validation, elapsed time) and RNG states;
- ``optim.py``: AdamW and the learning-rate schedule;
- ``losses.py``: the training loss of a batch and the validation loss;
- ``run_folder.py``: the run folder, and options resolved from defaults, a resumed run, a
  config file and flags;
- ``preflight.py``, ``metrics.py``, ``display.py``: the pre-flight screen, metrics.jsonl and
  loss.png, and the rich progress bar.
"""

from lmcli.train.loop import train
from lmcli.train.run import Reporter, TrainResult
from lmcli.train.run_folder import resolve_configs

__all__ = ["Reporter", "TrainResult", "resolve_configs", "train"]
