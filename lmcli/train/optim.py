"""The optimizer (AdamW, decay on matrices only; or Muon for the blocks' matrices with AdamW for
the rest) and the learning-rate schedule (warmup, then cosine, linear or warmup-stable-decay)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from lmcli.config.train import TrainConfig


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> Any:
    """AdamW (weight decay on matrices only), or with ``--optimizer muon`` a ``MuonAdamW``."""
    if cfg.optimizer_kind == "muon":
        return make_muon(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    return make_adamw(params, cfg, device)


def make_adamw(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (linear and embedding weights) only, not on biases/norms."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    optim = cfg.optim
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), **extra)


def muon_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable matrices inside the Transformer blocks (``h.N...``, 2-D): what Muon
    orthogonalizes. Embeddings, the head, positions, norms and biases are not among them."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and name.split(".")[0] == "h"
    ]


def make_muon(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> MuonAdamW:
    """``torch.optim.Muon`` (lr ``--muon-lr``, scaled by sqrt(max(1, rows/cols)) as Keller Jordan's
    original) for the blocks' matrices, AdamW (``--lr``) for everything else; lmcli's ``Muon``
    on a CPU (float32 iteration) and for sharded matrices (each orthogonalized whole)."""
    matrices = muon_parameters(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    sharded = any(is_dtensor(p) for p in matrices)
    options = {
        "lr": cfg.optim.muon_lr,
        "momentum": cfg.optim.muon_momentum,
        "weight_decay": 0.0,
        "nesterov": True,
    }
    groups = [{"params": matrices, "peak_lr": cfg.optim.muon_lr}]
    if device.type == "cpu":
        muon: torch.optim.Optimizer = Muon(groups, **options)
    elif sharded:  # on a GPU the iteration in bfloat16, as torch's
        muon = Muon(groups, ns_dtype=torch.bfloat16, **options)
    else:
        muon = torch.optim.Muon(groups, **options)
    return MuonAdamW(muon, make_adamw(rest, cfg, device))


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iteration in float32 instead of bfloat16 (on a
    CPU), and for matrices sharded across processes (FSDP).

    torch's runs the iteration in bfloat16, fast on GPUs; on a CPU without bfloat16 matrix
    units those products are emulated and slow (this project's CPUs: one run took several times
    the CPU time of AdamW's), and bfloat16 rounding then dominates the update's error. The
    arithmetic is otherwise torch's: the same momentum buffer (its ``state_dict`` is
    interchangeable), Nesterov, decoupled weight decay, coefficients and shape adjustment.

    Newton-Schulz needs each matrix whole. Sharded matrices are spread over the processes
    (``spread_orthogonalize``): each matrix is gathered on one process, orthogonalized there
    and its rows scattered back, so each process iterates on about 1/N of the matrices (the
    alternative, every process gathering every matrix and iterating on all of them, repeats
    the whole iteration on every process).
    """

    def __init__(self, params: Any, *, ns_dtype: torch.dtype = torch.float32, **options: Any) -> None:
        super().__init__(params, **options)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            params, updates = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                params.append(p)
                updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
            orthogonal = functools.partial(newton_schulz, group=group, dtype=self.ns_dtype)
            if any(is_dtensor(u) for u in updates):
                results = spread_orthogonalize(updates, orthogonal, self.ns_dtype)
            else:
                results = [orthogonal(u) for u in updates]
            for p, x in zip(params, results, strict=True):
                rows, cols = p.shape
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    scale = 0.2 * max(rows, cols) ** 0.5
                else:  # None or "original"
                    scale = max(1.0, rows / cols) ** 0.5
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(x.to(p.dtype), alpha=-lr * scale)


def newton_schulz(update: torch.Tensor, group: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The update (rows, cols) orthogonalized by torch's Newton-Schulz iteration, in ``dtype``."""
    a, b, c = group["ns_coefficients"]
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # (rows <= cols): the Gram matrix below is the smaller one
    x = x / x.norm().clamp(min=group["eps"])  # spectral norm at most 1
    for _ in range(group["ns_steps"]):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def spread_orthogonalize(
    updates: list[torch.Tensor], orthogonal: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> list[torch.Tensor]:
    """``orthogonal`` (which returns ``dtype``) of each row-sharded matrix (FSDP's DTensors),
    each computed whole on one process: the matrices are given to the processes by their cost
    (rows·cols·min(rows,cols), largest first, to the least loaded), gathered there,
    orthogonalized, and their rows scattered back; the results are sharded as the updates are."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mesh = updates[0].device_mesh
    group = mesh.get_group()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    owner = owners([tuple(u.shape) for u in updates], world)
    chunks = [-(-u.shape[0] // world) for u in updates]  # FSDP's rows per process (the last fewer)
    gathered, waits = {}, []
    for i, u in enumerate(updates):
        local = _padded(u.to_local(), chunks[i])
        parts = [torch.empty_like(local) for _ in range(world)] if me == owner[i] else None
        waits.append(dist.gather(local, parts, group_dst=owner[i], group=group, async_op=True))
        if parts is not None:
            gathered[i] = parts
    for work in waits:
        work.wait()
    done = {i: orthogonal(torch.cat(parts)[: updates[i].shape[0]]) for i, parts in gathered.items()}
    received, waits = [], []
    for i, u in enumerate(updates):
        into = torch.empty(chunks[i], u.shape[1], dtype=dtype, device=u.device)
        parts = list(_padded(done[i], chunks[i] * world).split(chunks[i])) if me == owner[i] else None
        waits.append(dist.scatter(into, parts, group_src=owner[i], group=group, async_op=True))
        received.append(into)
    for work in waits:
        work.wait()
    return [
        DTensor.from_local(r[: u.to_local().shape[0]], mesh, u.placements, shape=u.shape, stride=u.stride())
        for r, u in zip(received, updates, strict=True)
    ]


def owners(shapes: list[tuple[int, ...]], world: int) -> list[int]:
    """Which process orthogonalizes each matrix: largest first, to the least loaded (the same
    answer on every process)."""
    load = [0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        owner[i] = min(range(world), key=lambda r: (load[r], r))
        load[owner[i]] += _cost(shapes[i])
    return owner


def _cost(shape: tuple[int, ...]) -> int:
    rows, cols = shape
    return rows * cols * min(rows, cols)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x.contiguous()
    pad = x.new_zeros(rows - x.shape[0], *x.shape[1:])
    return torch.cat([x, pad])


class MuonAdamW:
    """Two optimizers stepped as one: Muon for the hidden matrices, AdamW for the rest.

    It has what the training loop, ``GradScaler`` and a checkpoint use of an optimizer:
    ``param_groups`` (Muon's first; a group's ``peak_lr`` is its own peak learning rate),
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``.
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict[Any, Any]:
        return {**self.muon.state, **self.adamw.state}

    def step(self, closure: Any = None) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def lr_at(step: int, cfg: TrainConfig, max_steps: int | None, time_fraction: float = 0.0) -> float:
    """Linear warmup to ``lr``, then the ``--schedule`` down to ``lr * min_lr_ratio`` at the end.

    cosine and linear decay from the end of warmup to the end of the run; wsd stays at ``lr``
    and decays linearly over the last ``--decay-fraction`` of the run. The end is ``max_steps``;
    a run limited only by ``--max-time`` decays over the time budget.
    """
    sched, peak = cfg.schedule, cfg.optim.lr
    if step < sched.warmup_steps:
        return peak * (step + 1) / (sched.warmup_steps + 1)
    floor = peak * sched.min_lr_ratio
    if cfg.schedule_kind == "wsd":
        done = step / max_steps if max_steps is not None else time_fraction
        left = 1.0 - min(max(done, 0.0), 1.0)  # fraction of the run still ahead
        if left >= sched.decay_fraction:
            return peak
        return floor + (peak - floor) * left / sched.decay_fraction
    if max_steps is not None:
        span = max(max_steps - sched.warmup_steps, 1)
        progress = min((step - sched.warmup_steps) / span, 1.0)
    else:
        progress = min(max(time_fraction, 0.0), 1.0)
    if cfg.schedule_kind == "linear":
        return floor + (1.0 - progress) * (peak - floor)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def group_lr(group: dict[str, Any], lr: float, cfg: TrainConfig) -> float:
    """A parameter group's rate when the schedule gives ``lr`` for ``--lr``: Muon's groups follow
    the same schedule from their own peak (``peak_lr``)."""
    peak = group.get("peak_lr")
    return lr if peak is None else lr / cfg.optim.lr * peak
