"""The optimizer (AdamW, decay on matrices only; or Muon for the blocks' matrices with AdamW for
the rest) and the learning-rate schedule (warmup, then cosine, linear or warmup-stable-decay)."""

from __future__ import annotations

import math
from typing import Any

import torch

from lmcli.config import TrainConfig


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
    original) for the blocks' matrices, AdamW (``--lr``) for everything else."""
    matrices = muon_parameters(model)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    muon = (Muon if device.type == "cpu" else torch.optim.Muon)(
        [{"params": matrices, "peak_lr": cfg.optim.muon_lr}],
        lr=cfg.optim.muon_lr,
        momentum=cfg.optim.muon_momentum,
        weight_decay=0.0,
        nesterov=True,
    )
    return MuonAdamW(muon, make_adamw(rest, cfg, device))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iteration in float32 instead of bfloat16.

    torch's runs the iteration in bfloat16, fast on GPUs; on a CPU without bfloat16 matrix
    units those products are emulated and slow (this project's CPUs: one run took several times
    the CPU time of AdamW's), and bfloat16 rounding then dominates the update's error. The
    arithmetic is otherwise torch's: the same momentum buffer (its ``state_dict`` is
    interchangeable), Nesterov, decoupled weight decay, coefficients and shape adjustment.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, momentum, (a, b, c) = group["lr"], group["momentum"], group["ns_coefficients"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                x = update.float()
                tall = x.size(0) > x.size(1)
                if tall:
                    x = x.T  # (rows <= cols): the Gram matrix below is the smaller one
                x = x / x.norm().clamp(min=group["eps"])  # spectral norm at most 1
                for _ in range(group["ns_steps"]):
                    gram = x @ x.T
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                if tall:
                    x = x.T
                rows, cols = p.shape
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    scale = 0.2 * max(rows, cols) ** 0.5
                else:  # None or "original"
                    scale = max(1.0, rows / cols) ** 0.5
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(x.to(p.dtype), alpha=-lr * scale)


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
