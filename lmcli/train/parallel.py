"""How the processes of a run share the model (``--parallel``), chosen once: the loop calls the
same methods whatever was chosen.

- ``Single``: one process, the model as it is;
- ``Replicated``: ``DistributedDataParallel``, a whole model per process, gradients all-reduced;
- ``Sharded``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every Transformer block and at
  the root: each process holds a slice (rows) of every parameter, of its gradient and of its
  optimizer state; a block's parameters are all-gathered for its forward and again for its
  backward, its gradients reduce-scattered. On a GPU parameters compute in the autocast dtype
  (bf16) and gradients are reduced in float32 (``MixedPrecisionPolicy``); on a CPU all in
  float32. Checkpoints are sharded (``lmcli.train.sharded``).

Each ``wrap``s the model for training (activation checkpointing, the parallel wrapper,
``torch.compile``), tells a micro-batch whether it is the last of the step (``micro_batch``),
and saves and restores checkpoints. ``clip_grad_norm`` and ``load_into`` work on plain and
sharded (DTensor) parameters alike.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.model import lora
from lmcli.model.transformer import Transformer
from lmcli.tasks import make_task
from lmcli.train.activations import checkpoint_blocks
from lmcli.train.distributed import Dist
from lmcli.train.sharded import Contents, save_sharded, save_whole

Fill = Callable[[Transformer], None]  # puts weights into a model whose tensors are allocated


def launched_by_torchrun() -> bool:
    """Whether this process is one of a ``torchrun`` job (its environment names the job; or, from
    another launcher, its RANK and WORLD_SIZE)."""
    job = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ
    return job or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def check_launch(cfg: TrainConfig) -> None:
    """One line when ``--parallel ddp|fsdp`` is asked of a process that torchrun did not start."""
    chosen = cfg.parallelism.parallel
    if chosen != "auto" and not launched_by_torchrun():
        raise LmcliError(
            f"--parallel {chosen} needs torchrun: torchrun --nproc_per_node=N -m lmcli train ... "
            f"--parallel {chosen} (one process trains without it)"
        )


def choose_parallel(cfg: TrainConfig, dist_info: Dist, need: int, available: int | None) -> str:
    """``none``, ``ddp`` or ``fsdp``: ``--parallel``; ``auto`` shards (fsdp) when several processes
    run and the pre-flight's ``need`` (bytes for one whole replica: weights, gradients, optimizer
    state, activations) is over what one device has (``available``), else replicates (ddp)."""
    chosen = cfg.parallelism.parallel
    if chosen == "auto":
        fits = available is None or need <= available
        chosen = "ddp" if fits or not dist_info.enabled else "fsdp"
    if chosen == "fsdp" and make_task(cfg).decodes_bleu():
        raise LmcliError(
            "--parallel fsdp cannot decode BLEU samples during training (rank 0 decodes alone); "
            "give --bleu-samples 0 and score the checkpoints with lmcli eval"
        )
    whole = make_task(cfg).whole
    if chosen == "fsdp" and whole:  # dpo, grpo, distill
        raise LmcliError(
            f"--parallel fsdp does not run --task {cfg.task} yet ({whole} need whole weights): use "
            "--parallel ddp, or LoRA (--lora-rank) to fit one device"
        )
    return chosen if chosen == "fsdp" or dist_info.enabled else "none"


def per_process_memory(available: int | None, device: torch.device) -> int | None:
    """What one process may use of ``available``: a GPU is its own; a CPU's RAM is shared by the
    node's processes."""
    if available is None or device.type == "cuda":
        return available
    return available // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def make_parallel(kind: str, cfg: TrainConfig, dist_info: Dist, device: torch.device, amp: Any) -> Single:
    """The ``Single``, ``Replicated`` or ``Sharded`` object of a run."""
    cls = {"none": Single, "ddp": Replicated, "fsdp": Sharded}[kind]
    return cls(cfg, dist_info, device, amp)


@dataclass
class Single:
    """One process holds the whole model: the model as it is, whole checkpoints by rank 0."""

    cfg: TrainConfig
    dist: Dist
    device: torch.device
    amp: torch.dtype | None

    name = "none"
    sharded = False  # whether each process holds only a slice of every parameter

    def describe(self) -> str:
        return f"{self.dist.world_size}"

    def wrap(self, model: Transformer, averages: list[Any], fill: Fill | None = None) -> torch.nn.Module:
        """What runs forward and backward: ``model`` on the device (its weights put in by ``fill``
        if it was built on the meta device), its blocks recomputing with
        ``--activation-checkpointing``, compiled with ``--compile``; the weight averages' modules
        made alike (on the device, sharded as the model is)."""
        materialize(model, self.device, fill)
        for average in averages:
            materialize(average.module, self.device, None)
            average.start_from(model)
        checkpoint_blocks(model, self.cfg.parallelism.activation_checkpointing)
        model.positions.reach(model.config.block_size)  # whole now: no table grows in a compiled forward
        trained = self.parallel_wrapper(model)
        return torch.compile(trained) if self.cfg.compile else trained

    def parallel_wrapper(self, model: Transformer) -> torch.nn.Module:
        return model

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's forward and backward (``last``: the step's last)."""
        return contextlib.nullcontext()

    def save(self, dest: Path, module: torch.nn.Module, contents: Contents) -> None:
        """Write the checkpoint folder ``dest`` of ``module`` and its ``contents`` (every rank
        calls it)."""
        save_whole(dest, module, self.dist, contents)

    def finish(self) -> None:
        """Wait for checkpoint writes still under way, and put them in place."""

    def restore(self, resumed: Any, model: torch.nn.Module, states: Any) -> None:
        """A resumed run's state from its checkpoint, whole or sharded (any number of processes)."""
        from lmcli.train.sharded import restore_run

        restore_run(resumed, model, states, self.cfg)


class Replicated(Single):
    """DistributedDataParallel: a whole replica per process, gradients all-reduced once a step."""

    name = "ddp"

    def describe(self) -> str:
        return f"{self.dist.world_size} (DDP)"

    def parallel_wrapper(self, model: Transformer) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        # no buffer is trained (position tables are constants): no broadcast before each forward;
        # gradients live in the all-reduce buckets, no copy in and out of them
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )
        return self.ddp

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces gradients only on the last micro-batch of a step
        return contextlib.nullcontext() if last else self.ddp.no_sync()


class Sharded(Single):
    """FSDP2: parameters, gradients and optimizer state sharded over the processes."""

    name = "fsdp"
    sharded = True

    def describe(self) -> str:
        return f"{self.dist.world_size} (FSDP, parameters sharded)"

    pending: Any = None  # a sharded checkpoint still being written (lmcli.train.sharded.Pending)
    group: Any = None  # the processes' group for background checkpoint writes

    def wrap(self, model: Transformer, averages: list[Any], fill: Fill | None = None) -> torch.nn.Module:
        checkpoint_blocks(model, self.cfg.parallelism.activation_checkpointing)
        kept = drawn_tensors(model) if is_meta(model) else {}
        self.shard(model)
        materialize(model, self.device, fill, kept)
        for average in averages:
            self.shard(average.module)
            materialize(average.module, self.device, None)
            average.start_from(model)
        self.root = model
        return torch.compile(model) if self.cfg.compile else model

    def shard(self, model: Transformer) -> None:
        """``fully_shard`` each block, then the root (embeddings, final norm, head); the last
        block stays gathered after its forward, as its backward comes first."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.dist.world_size,))
        mp = MixedPrecisionPolicy()
        if self.device.type == "cuda" and self.amp is not None:
            mp = MixedPrecisionPolicy(param_dtype=self.amp, reduce_dtype=torch.float32)
        if is_meta(model):
            model.to("meta")  # one device for all: tensors drawn on the CPU were kept aside
        for i, block in enumerate(model.h):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.h) - 1)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        # gradients are reduce-scattered after every micro-batch (each process keeps sharded
        # gradients only: unsharded ones would cost a whole model's gradients per process); the
        # root's parameters (embeddings, head) stay gathered until the step's last backward
        self.root.set_reshard_after_backward(last, recurse=False)
        return contextlib.nullcontext()

    def save(self, dest: Path, module: torch.nn.Module, contents: Contents) -> None:
        self.finish()  # one write at a time: the previous one is put in place first
        if self.group is None:  # its own: the background writes' collectives beside training's
            self.group = torch.distributed.new_group(backend="gloo")
        self.pending = save_sharded(dest, module, self.dist, contents, group=self.group)

    def finish(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.commit()


# ----------------------------------------------------------------------------- tensors


def is_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (its weights to be put in)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def drawn_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The parameters of a model built on the meta device that hold values already (LoRA
    adapters, drawn on the CPU): kept aside while the model is sharded, put back after."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}


def materialize(
    model: Transformer, device: torch.device, fill: Fill | None, kept: dict[str, torch.Tensor] | None = None
) -> None:
    """``model`` on ``device``: a model built on the meta device gets its tensors allocated,
    the tied head tied again, its position tables computed, then ``fill`` and ``kept`` put in
    its weights (each process its own rows of a sharded parameter)."""
    if not is_meta(model):
        model.to(device)
        return
    kept = drawn_tensors(model) if kept is None else kept
    model.to_empty(device=device)
    if model.config.tie_embeddings and model.lm_head.weight is not model.wte.weight:
        model.lm_head.weight = model.wte.weight
    with torch.device("cpu"):  # where a freshly built model computes them, for the same values
        model.positions.make_tables(model.config)
    model.positions.to(device)
    if fill is not None:
        fill(model)
    load_into(model, kept.items())


def load_into(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], where: str = ""
) -> set[str]:
    """Copy whole tensors (names as the model's parameters) into ``model``: a sharded
    parameter takes only this process's rows (nothing is sent between processes); the names
    filled. One line for a tensor the model lacks or whose shape differs."""
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for name, full in tensors:
            if name not in params:
                raise LmcliError(f"weights {where} do not fit the model config (unexpected: {name})")
            if tuple(full.shape) != tuple(params[name].shape):
                raise LmcliError(
                    f"weights {where}: {name} has shape {tuple(full.shape)}, "
                    f"config expects {tuple(params[name].shape)}"
                )
            local_copy(params[name], full)
            filled.add(name)
    return filled


def fill_from_hf(model: Transformer, folder: Any) -> None:
    """A Hugging Face folder's weights into ``model`` (placed, perhaps sharded), one block at a
    time: each process reads and keeps its own rows (``lmcli.formats.hf.load.read_blocks``)."""
    from lmcli.formats.hf.load import read_blocks
    from lmcli.formats.weights import MODULE_NAMES

    where = f"in {folder.path}"
    blocks = read_blocks(folder, torch.float32)
    rows = model.config.block_size  # learned positions cut to the run's context (lmcli.train.init_from)
    named = (
        (MODULE_NAMES.get(k, k), v[:rows] if k == "wpe.weight" else v)
        for block in blocks
        for k, v in block.items()
    )
    filled = load_into(model, named, where)
    adapters = lora.ADAPTER_KEYS  # drawn, not read
    missing = [n for n, _ in model.named_parameters() if n not in filled and not n.endswith(adapters)]
    if missing:
        raise LmcliError(f"weights {where} do not fit the model config (missing: {', '.join(missing[:3])})")


def local_copy(param: torch.Tensor, full: torch.Tensor) -> None:
    """``param`` (plain, or a DTensor shard) set from the whole tensor ``full``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    rows = tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))
    param.to_local().copy_(full[rows])


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for plain and sharded (DTensor) gradients alike: the
    norm over all of them (a sharded one's summed across processes), each scaled if above."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm or math.inf, norm)
    return norm
