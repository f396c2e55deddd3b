"""What one training run holds (``Run``), what its task does in each step (``Method``), where
its words go (``Reporter``) and what it returns (``TrainResult``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.data.preferences import PromptData
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
from lmcli.train.preflight import Preflight, estimated_memory
from lmcli.train.state import Stateful, StateRegistry, TrainState
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


M = TypeVar("M")  # a method's micro-batch: a Batch of windows or examples, a PairBatch, a rollout Group


class Method(Generic[M]):
    """What a run's task does in the loop, asked the same way for every task: ``train/loop.py``
    never asks which method it runs. ``NextToken`` (``train/losses.py``: lm, translation, sft)
    and the post-training methods of ``train/post/`` (``DPO``, ``GRPO``) are the ones there are.

    A step is ``passes`` optimizer steps over the micro-batches ``micro_batches`` gives (one
    pass, but GRPO's ``--grpo-steps``); the backward of each runs on its ``loss``, its share of
    the step's loss. A validation is ``validate``: the number ``best/`` follows and the fields
    logged. Between log points a method may gather its own fields (``logged``); its stateful
    parts (``parts``) are saved in ``trainer_state.pt`` and restored on resume (a record a
    resumed run must match, such as a teacher's identity, refuses a mismatch in its
    ``load_state_dict``); the progress bar shows the logged fields it names (``shown``); the
    windows or examples a step reads come from its ``sampler``; the pre-flight asks
    ``describe``, ``memory`` and ``extra_seconds``.
    Every method is opened by one function (``train.post.open_method``) from the run's config,
    model, resumed checkpoint and data; a new one needs nothing of the loop (docs/post-training.md).
    """

    passes: int = 1  # optimizer steps over one step's micro-batches
    baseline: bool = False  # validate the starting model at step 0 (logged; it sets no best)
    probes: bool = True  # the pre-flight may time one plain step of the sampler's batches
    # the logged fields the progress bar shows: (field, label, format), when a log point has them
    shown: tuple[tuple[str, str, str], ...] = ()

    def sampler(self, data: TrainData | PromptData, batch_size: int, seed: int) -> Any:
        """What the run's steps read (``Run.sampler``): by default the data's own sampler."""
        return data.sampler(batch_size, seed)

    def micro_batches(self, run: Run) -> Iterable[M]:
        """This step's ``grad_accum`` micro-batches of this rank, on the run's device; reading
        them advances ``run.state.cursor``. A method with more than one pass returns a sequence."""
        raise NotImplementedError

    def loss(self, model: nn.Module, micro: M) -> Tensor:
        """A micro-batch's share of the step's loss (a scalar, with gradient): the shares of a
        step add up to its loss (the mean over a step's micro-batches: each one's mean loss
        divided by ``grad_accum``); the training loss logged is their sum."""
        raise NotImplementedError

    def validate(self, run: Run) -> tuple[float, dict[str, float]]:
        """The validation: the number ``best/`` follows (lower is better) and the record's
        fields (``val_...``), logged with the step (every rank calls it)."""
        raise NotImplementedError

    def summary(self, record: dict[str, Any]) -> str:
        """A validation's record in words (the line after each validation)."""
        raise NotImplementedError

    def best(self, best_loss: float) -> str:
        """The best validation, in the closing line."""
        return f"best validation loss {best_loss:.4f}"

    def logged(self) -> dict[str, float]:
        """The fields this method adds to a log point (means since the last one)."""
        return {}

    def parts(self) -> dict[str, Stateful]:
        """Stateful parts of the method, by name, saved with the trainer state."""
        return {}

    def begin(self, run: Run, fresh: bool) -> None:
        """Work before the first step, once the run is open (``fresh``: a new run, not a resume)."""

    def describe(self) -> dict[str, str]:
        """The pre-flight's rows about the method (label -> value)."""
        return {}

    def extra_seconds(self, run: Run) -> float:
        """Seconds a step spends beside the plain training step the pre-flight times (a
        teacher's forward), measured or estimated once, before training."""
        return 0.0

    def context(self, run: Run) -> int | None:
        """The longest sequence a micro-batch holds, in tokens (None: the model's context)."""
        return None

    def memory(self, run: Run, shards: int) -> int:
        """Bytes a process needs for a step, estimated without running one: by default the
        training step of a micro-batch of ``context``-token sequences (weights, gradients and
        optimizer state split over ``shards`` processes; ``preflight.estimated_memory``); a
        method adds what it holds beside (a reference or teacher model, a decoding cache)."""
        return estimated_memory(run.model, run.cfg, run.amp, run.device, shards, self.context(run))

    def close(self) -> None:
        """Release what the method holds outside the process (a worker); the run has ended."""


def sampler_batches(run: Run) -> Iterator[Any]:
    """This step's micro-batches from the run's sampler, read one at a time as the loop asks:
    this rank's rows of each global batch, on the device."""
    size = run.cfg.optim.batch_size
    for _ in range(run.cfg.optim.grad_accum):
        batch = run.sampler.batch(run.state.cursor + run.dist.rank * size, size)
        run.state.cursor += run.global_batch
        yield batch.to(run.device, run.staging)


@dataclass
class Run:
    """Everything one training run holds, built once by ``open_run``: its options (``cfg``, read
    by section), data and model, the stateful parts (registered once in ``states``, which is
    what a checkpoint saves and a resume restores) and the loop's ``marks``."""

    cfg: TrainConfig
    model_config: ModelConfig
    run_dir: Path
    source: Path | None  # the run folder a resumed run started from (itself, or another: --out)
    data: TrainData | PromptData
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
    method: Method[Any]  # what a step of its task does: its micro-batches, loss, validation (``Method``)
    staging: Staging | None = None  # batches' copies to a GPU, through reused pinned buffers
    base: dict[str, Any] | None = None  # a LoRA run's base reference (lora_base.base_reference)
    eval_tasks: list[Any] | None = None  # --eval-task files, scored at each validation (task_scores)

    @property
    def global_batch(self) -> int:
        return self.cfg.optim.batch_size * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:
        return round(self.global_batch * self.cfg.optim.grad_accum * self.data.tokens_per_example())

    def done(self) -> bool:
        return self.max_steps is not None and self.state.step >= self.max_steps
