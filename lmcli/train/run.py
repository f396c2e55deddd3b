"""What one training run holds (``Run``), where its words go (``Reporter``) and what it
returns (``TrainResult``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.data.train_data import TrainData
from lmcli.device import (
    Staging,
)
from lmcli.model.transformer import Transformer
from lmcli.train.averaging import EMA
from lmcli.train.distributed import (
    Dist,
)
from lmcli.train.metrics import MetricsLog
from lmcli.train.mfu import MfuBasis
from lmcli.train.parallel import (
    Single,
)
from lmcli.train.preflight import (
    Preflight,
)
from lmcli.train.state import StateRegistry, TrainState
from lmcli.train.tracking import Trackers


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    elapsed: float
    stopped: str  # "max_steps", "max_time", "SIGINT", "SIGTERM"


@dataclass
class Reporter:
    """Where the loop's words go; the CLI passes rich-backed callables, tests the defaults."""

    info: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    preflight: Callable[[Preflight, dict[str, str]], None] | None = None
    progress: Any = None  # an object with start(total, step, max_time), update(step, record), stop()


@dataclass
class Marks:
    """Where the loop stands between log points, validations and checkpoints (not saved: a
    resumed run starts them at its step)."""

    running: torch.Tensor  # the summed training loss since the last log point (on the device)
    log_step: int = 0  # the step and time of the last log point
    log_time: float = 0.0
    train_loss: float | None = None  # the last logged training loss
    val_loss: float | None = None  # the last validation loss
    val_step: int = -1  # the step of the last validation
    saved_step: int = -1  # the step of the last checkpoint


@dataclass
class Run:
    """Everything one training run holds, built once by ``open_run``: its options (``cfg``, read
    by section), data and model, the stateful parts (registered once in ``states``, which is
    what a checkpoint saves and a resume restores) and the loop's ``marks``."""

    cfg: TrainConfig
    model_config: ModelConfig
    run_dir: Path
    source: Path | None  # the run folder a resumed run started from (itself, or another: --out)
    data: TrainData
    sampler: Any  # a WindowSampler or an ExampleSampler
    model: Transformer  # what is saved and evaluated (its parameters sharded under FSDP)
    trained: torch.nn.Module  # what runs forward/backward: the model, or its DDP/compiled wrapper
    parallel: Single  # how the processes share the model: one, DDP or FSDP (lmcli.train.parallel)
    device: torch.device
    amp: torch.dtype | None  # the autocast dtype, None for float32
    dist: Dist
    max_steps: int | None
    state: TrainState  # step, data cursor, bests, elapsed time
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    averages: list[EMA]  # weight averages (--ema): updated each step, validated, saved as their own folder
    states: StateRegistry  # the above, and the RNGs: trainer_state.pt
    marks: Marks
    metrics: MetricsLog  # metrics.jsonl: read back for history and the plot
    trackers: Trackers  # where records go as they are made: metrics.jsonl and --log-to's backends
    mfu: MfuBasis
    info: Callable[[str], None]  # rank 0's messages; silent on the other ranks
    staging: Staging | None = None  # batches' copies to a GPU, through reused pinned buffers
    base: dict[str, Any] | None = None  # a LoRA run's base reference (lora_base.base_reference)
    eval_tasks: list[Any] | None = None  # --eval-task files, scored at each validation (task_scores)
    post: Any = None  # --task dpo/grpo: the reference and the step (train.posttrain.PostTraining)

    @property
    def global_batch(self) -> int:
        return self.cfg.optim.batch_size * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:
        return round(self.global_batch * self.cfg.optim.grad_accum * self.data.tokens_per_example())

    def done(self) -> bool:
        return self.max_steps is not None and self.state.step >= self.max_steps
