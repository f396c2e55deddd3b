"""The losses training reads: a batch's loss (of ``evaluate.forward_scored``'s logits) and the
validation loss across ranks; ``NextToken``, the method of the tasks that learn the next token
of their data (lm, translation, sft)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from lmcli.config.train import TrainConfig
from lmcli.data.train_data import ExampleData, TrainData
from lmcli.data.windows import Batch
from lmcli.device import autocast
from lmcli.eval.perplexity import forward_scored
from lmcli.tasks import make_task
from lmcli.train.distributed import Dist
from lmcli.train.run import Method, Run, sampler_batches


def batch_loss(model: torch.nn.Module, batch: Batch, cfg: TrainConfig) -> torch.Tensor:
    """The training loss of a batch: mean cross-entropy of its scored tokens (label smoothed)."""
    logits, targets = forward_scored(model, batch, make_task(cfg).prefix_lm)
    return F.cross_entropy(logits.float(), targets, label_smoothing=cfg.optim.label_smoothing)


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    data: TrainData,
    cfg: TrainConfig,
    device: torch.device,
    amp: torch.dtype | None,
    dist_info: Dist,
) -> float:
    """Mean validation loss (nats per scored token) over a fixed validation set, across ranks."""
    was_training = model.training
    model.eval()
    nll = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device
    scored = 0  # scored tokens, counted on the host (no device tensor, no sync per batch)
    size = cfg.optim.batch_size
    limit = cfg.validation.eval_batches * size * dist_info.world_size  # the same windows at any world size
    prefix_lm = make_task(cfg).prefix_lm
    for batch in data.val_batches(size, limit, dist_info.rank, dist_info.world_size):
        scored += batch.n_targets
        with autocast(device, amp):
            logits, targets = forward_scored(model, batch.to(device), prefix_lm)
        nll += F.cross_entropy(logits.float(), targets, reduction="sum")
    total = torch.stack([nll, torch.tensor(float(scored), dtype=torch.float64, device=device)])
    if dist_info.enabled:
        torch.distributed.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


def probe_step_seconds(
    model: torch.nn.Module, sampler: Any, cfg: TrainConfig, device: torch.device, amp: torch.dtype | None
) -> float:
    """Time one forward/backward micro-step without touching the RNG, weights or data position.

    On a GPU the allocator's peak is reset first: ``torch.cuda.max_memory_allocated`` then
    reads the step's peak memory (``lmcli.train.preflight.measured_memory``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        b = sampler.batch(0, cfg.optim.batch_size).to(device)
        times = []
        for _ in range(2):  # the first call warms up allocators and kernels
            t0 = time.perf_counter()
            with autocast(device, amp):
                logits, targets = forward_scored(model, b, make_task(cfg).prefix_lm)
                loss = F.cross_entropy(logits.float(), targets)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times[-1] * 1.15  # the optimizer step and data loading add a little


class NextToken(Method[Batch]):
    """``--task lm``, ``translation``, ``sft``: each micro-batch's mean cross-entropy of its
    scored tokens (``batch_loss``); validation: the loss and perplexity of the validation set."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    def micro_batches(self, run: Run) -> Iterator[Batch]:
        return sampler_batches(run)

    def loss(self, model: torch.nn.Module, micro: Batch) -> torch.Tensor:
        return batch_loss(model, micro, self.cfg) / self.cfg.optim.grad_accum

    def validate(self, run: Run) -> tuple[float, dict[str, float]]:
        loss = evaluate_loss(run.model, run.data, self.cfg, run.device, run.amp, run.dist)
        return loss, {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}

    def summary(self, record: dict[str, Any]) -> str:
        return f"val loss {record['val_loss']:.4f} (ppl {record['val_ppl']:.2f})"

    def context(self, run: Run) -> int | None:
        """Examples are often far shorter than an imported model's context: the longest."""
        return run.data.longest_example() if isinstance(run.data, ExampleData) else None
