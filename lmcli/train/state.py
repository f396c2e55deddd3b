"""What a resumed run needs beyond its weights, and the one mechanism that saves and restores it.

Every stateful part of training (the counters of ``TrainState``, the optimizer, the grad scaler,
the weight average, every rank's RNGs) is a ``Stateful``: it has ``state_dict`` and
``load_state_dict``. ``open_run`` registers each once in a ``StateRegistry``, whose
``state_dict`` is the whole of ``trainer_state.pt``; resuming is its ``load_state_dict``. The
file holds tensors and plain lists only, so ``torch.load(weights_only=True)`` reads it without
unpickling arbitrary objects. (The registry is what ``torch.distributed.checkpoint`` takes as
its state dict: ``Stateful`` is its protocol.)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from lmcli.train.distributed import Dist


class Stateful(Protocol):
    """A part of training with state to save (``torch.distributed.checkpoint.stateful.Stateful``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...


COUNTERS = "counters"  # the part whose state sits at the top level of trainer_state.pt (lmcli 0.1)


class StateRegistry:
    """Every stateful part of a run, by name, saved and restored together.

    ``trainer_state.pt`` maps each name to its part's state (``optimizer``, ``scaler``, ``rng``,
    ``ema``, ...), except ``COUNTERS`` (``TrainState``), whose keys sit at the top level as in
    every run folder so far. On resume a part whose state is missing or empty starts from where
    it is: a part the saved run did not have (``--ema`` added on resume), a scaler the saved run
    did not use (bf16 -> float16). A saved part this run does not have is ignored.
    """

    def __init__(self, parts: dict[str, Stateful]) -> None:
        self.parts = dict(parts)

    def state_dict(self) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        for name, part in self.parts.items():
            if name == COUNTERS:
                saved.update(part.state_dict())
            else:
                saved[name] = part.state_dict()
        return saved

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            state = saved if name == COUNTERS else saved.get(name)
            if state:
                part.load_state_dict(state)


@dataclass
class TrainState:
    """The trainer's counters: where the run is, and the best it has done."""

    step: int = 0  # optimizer steps taken
    cursor: int = 0  # training windows (or pairs) consumed, by all ranks together
    best_val: float = math.inf  # the lowest validation loss so far
    elapsed: float = 0.0  # seconds of training before this session
    best_score: float = -math.inf  # the highest --select score (BLEU, chrF) so far
    best_score_loss: float = math.inf  # the validation loss at that score (breaks ties)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "best_val": self.best_val,
            "elapsed": self.elapsed,
            "best_score": self.best_score,
            "best_score_loss": self.best_score_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.best_val = float(state.get("best_val", math.inf))
        self.elapsed = float(state.get("elapsed", 0.0))
        self.best_score = float(state.get("best_score", -math.inf))
        self.best_score_loss = float(state.get("best_score_loss", math.inf))


class RngStates:
    """The RNGs of every rank as one part: ``state_dict`` gathers each rank's (a collective:
    every rank calls it), ``load_state_dict`` gives this rank its own; a rank the saved run did
    not have keeps its seed."""

    def __init__(self, dist: Dist, device: torch.device | None = None) -> None:
        self.dist, self.device = dist, device

    def state_dict(self) -> list[dict[str, Any]]:
        mine = rng_state(self.device)
        if not self.dist.enabled:
            return [mine]
        gathered: list[Any] = [None] * self.dist.world_size
        torch.distributed.all_gather_object(gathered, mine, group=self.dist.control)
        return gathered

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if self.dist.rank < len(states):
            set_rng_state(states[self.dist.rank], self.device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every RNG's state, as tensors and plain lists (safe for ``torch.load(weights_only=True)``).

    Of the GPUs, only ``device``'s (this process's own): a resumed run may see fewer GPUs, or
    its rank another one, and every rank saves its own state anyway.
    """
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_state), py_gauss],
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore ``rng_state``'s states; a GPU state goes to ``device`` (this process's own GPU).

    Runs saved by earlier versions hold a list of every visible GPU's state: the one of this
    device's index is used when it exists (never an index of a GPU that is not there).
    """
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    saved = state.get("cuda")
    if saved is None or device is None or device.type != "cuda":
        return
    if isinstance(saved, (list, tuple)):  # every GPU's state (older runs)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= len(saved):
            return
        saved = saved[index]
    torch.cuda.set_rng_state(saved, device)
