"""Training beyond one process: joining a ``torchrun`` job and the few collectives lmcli needs.

Rank 0 alone names the run folder (``on_main``), fills caches first (``in_turn``), and every
rank stops at the same step (``agree_to_stop``). Data parallelism itself is PyTorch's DDP
or FSDP2 (``lmcli.train.parallel``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch

from lmcli.device import pick_device
from lmcli.errors import LmcliError

T = TypeVar("T")
STOP_REASONS = ("max_time", "SIGINT", "SIGTERM")  # weakest first: agree_to_stop keeps the strongest
# How long a rank waits for the others. The control group's collectives wait while rank 0 alone
# tokenizes a corpus or trains a tokenizer (``in_turn``), which can take hours on a large
# corpus; the training group's (gradients) should fail fast when a rank is gone.
SETUP_TIMEOUT = timedelta(hours=24)
STEP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Dist:
    """This process's place in a torchrun job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # a gloo group for small CPU-side collectives (stop flags, errors, objects) with the long
    # SETUP_TIMEOUT; None: the default group
    control: Any = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str, group: bool = False) -> tuple[Dist, torch.device]:
    """Join the torchrun job described by RANK/WORLD_SIZE (gloo on CPU, nccl on CUDA); a job of
    one process joins only with ``group`` (FSDP shards over a process group, even of one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not (group and "RANK" in os.environ):
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
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=STEP_TIMEOUT)
    # a CPU group for the control collectives, with the long setup timeout: under nccl it also
    # keeps per-step agreement from forcing a GPU sync
    control = dist.new_group(backend="gloo", timeout=SETUP_TIMEOUT)
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
