"""Where training runs: device choice, mixed precision, torch.distributed, RNG state."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from lmcli.errors import LmcliError

T = TypeVar("T")
STOP_REASONS = ("max_time", "SIGINT", "SIGTERM")  # weakest first: agree_to_stop keeps the strongest


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device must be available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmcliError("--device cuda requested but CUDA is not available")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise LmcliError("--device mps requested but MPS is not available")
    return torch.device(name)


def autocast_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """The autocast dtype for ``--dtype`` (None = plain float32). ``auto``: bf16 on CUDA."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return None
    if dtype == "float32":
        return None
    if dtype == "float16" and device.type == "cpu":
        raise LmcliError("--dtype float16 needs a GPU; use bfloat16 or float32 on the CPU")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def configure_backend(device: torch.device) -> None:
    """Fast-math settings: TF32 matmuls on CUDA (bf16 autocast does the rest)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass(frozen=True)
class Dist:
    """This process's place in a torchrun job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # a gloo group for small CPU-side collectives (stop flags, errors, objects); None: the default
    # group, which is gloo already when training on the CPU
    control: Any = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Join the torchrun job described by RANK/WORLD_SIZE (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(), pick_device(device_name)
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_name in ("auto", "cuda") and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = pick_device("cpu" if device_name == "auto" else device_name)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    # under nccl, a CPU group keeps per-step agreement from forcing a GPU sync
    control = dist.new_group(backend="gloo") if use_cuda else None
    return Dist(rank, local, world, control), device


def _failure(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def on_main(fn: Callable[[], T], dist_info: Dist) -> T:
    """``fn()`` run on rank 0 alone and its result given to every rank; its error fails every rank.

    For decisions one process must make (a run folder's name and whether it may be used): other
    ranks never race rank 0 to the file system.
    """
    if not dist_info.enabled:
        return fn()
    import torch.distributed as dist

    box: list[Any] = [None]
    try:
        if dist_info.is_main:
            box = [(True, fn())]
    except BaseException as exc:
        box = [(False, _failure(exc))]
        raise
    finally:
        dist.broadcast_object_list(box, src=0, group=dist_info.control)
    ok, value = box[0]
    if not ok:
        raise LmcliError(value)
    return value


def in_turn(fn: Callable[[], T], dist_info: Dist) -> T:
    """``fn()`` on every rank: rank 0 first, then the first process of each other node, then the rest.

    For work that fills a cache (tokenizing a corpus, training a tokenizer): the first process
    writes it, the others read it instead of racing to write the same files. An error on any
    rank is raised on every rank, so no rank is left waiting.
    """
    if not dist_info.enabled:
        return fn()
    import torch.distributed as dist

    my_turn = 0 if dist_info.is_main else 1 if dist_info.local_rank == 0 else 2
    result: Any = None
    for turn in range(3):
        error: BaseException | None = None
        if turn == my_turn:
            try:
                result = fn()
            except BaseException as exc:
                error = exc
        failures: list[Any] = [None] * dist_info.world_size
        dist.all_gather_object(failures, error and _failure(error), group=dist_info.control)
        if error is not None:
            raise error
        for message in failures:
            if message is not None:
                raise LmcliError(message)
    return result


def agree_to_stop(elapsed: float, reason: str | None, dist_info: Dist) -> tuple[float, str | None]:
    """The latest clock and the strongest stop reason over all ranks, the same on every rank.

    Ranks see a signal or the time limit at slightly different moments; deciding together keeps
    them at the same step (a rank stopping alone would leave the others waiting in a collective),
    and one clock gives every rank the same learning rate under ``--max-time``.
    """
    if not dist_info.enabled:
        return elapsed, reason
    import torch.distributed as dist

    code = 0 if reason is None else 1 + STOP_REASONS.index(reason)
    both = torch.tensor([elapsed, float(code)], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=dist_info.control)
    code = int(both[1].item())
    return float(both[0].item()), STOP_REASONS[code - 1] if code else None


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG's state, as tensors and plain lists (safe for ``torch.load(weights_only=True)``)."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_state), py_gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
