"""Training: the loop and everything a run needs around it.

- ``loop.py``: ``train``: the loop (step, log, validate, save) and its pieces;
- ``setup.py``: a run opened (options, folder, data, model placed, state restored, pre-flight);
- ``run.py``: what a run holds (``Run``), what its task does each step (``Method``: micro-batches,
  loss, validation, logged fields, state, pre-flight costs), ``Reporter``, ``TrainResult``;
- ``losses.py``: the training loss of a batch, the validation loss, and ``NextToken``, the method
  of lm, translation and sft;
- ``post/``: post-training, each method one object behind ``Method``: ``dpo.py``, ``grpo.py``,
  their pure losses (``preference.py``, ``policy.py``), ``reference.py``, ``rewards.py`` (and
  ``reward_worker.py``, the process a user's reward runs in), ``rollouts.py``; ``open_method``;
- ``signals.py``: stops (SIGINT, SIGTERM, ``--max-time``'s clock);
- ``state.py``: ``TrainState`` (step, data cursor, best validation, elapsed time), RNG states and
  the ``StateRegistry`` that saves and restores every stateful part;
- ``optim.py``: AdamW, Muon and the learning-rate schedule;
- ``averaging.py``: weight averages (``--ema``, ``lmcli average``);
- ``run_folder.py``: the run folder, and options resolved from defaults, a resumed run, a
  config file and flags;
- ``init_from.py``: ``--init-from``: the model a run starts from;
- ``parallel.py``, ``sharded.py``, ``distributed.py``, ``activations.py``: DDP/FSDP2, sharded
  checkpoints, torchrun, activation checkpointing;
- ``task_scores.py``: downstream tasks scored at each validation (``--eval-task``);
- ``preflight.py``, ``mfu.py``, ``metrics.py``, ``tracking.py``, ``display.py``: the pre-flight
  screen and its estimates, MFU, metrics.jsonl and loss.png, ``--log-to`` backends, and the rich
  progress bar.
"""

from lmcli.train.loop import train
from lmcli.train.run import Reporter, TrainResult
from lmcli.train.run_folder import resolve_configs

__all__ = ["Reporter", "TrainResult", "resolve_configs", "train"]
