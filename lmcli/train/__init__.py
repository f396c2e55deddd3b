"""Training: the loop and everything a run needs around it.

- ``loop.py``: ``train``: open a run, then the loop (step, log, validate, save) and its pieces;
- ``state.py``: ``TrainState`` (step, data cursor, best validation, elapsed time) and RNG states;
- ``optim.py``: AdamW and the learning-rate schedule;
- ``scoring.py``: the training loss of a batch and the validation loss;
- ``run_folder.py``: the run folder, and options resolved from defaults, a resumed run, a
  config file and flags;
- ``preflight.py``, ``metrics.py``, ``display.py``: the pre-flight screen, metrics.jsonl and
  loss.png, and the rich progress bar.
"""

from lmcli.train.loop import Reporter, TrainResult, train
from lmcli.train.run_folder import resolve_configs

__all__ = ["Reporter", "TrainResult", "resolve_configs", "train"]
