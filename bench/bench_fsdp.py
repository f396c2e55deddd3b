"""FSDP against DDP, and activation checkpointing against keeping every activation: memory.

1. Per-process memory of the training state: the 10.9M model (6 layers × 384, vocabulary 65)
   takes one AdamW step of 4 × 256 tokens on 2 CPU processes under ``torchrun`` (gloo), once
   wrapped as ``--parallel fsdp`` and once as ``--parallel ddp`` (``lmcli.train.parallel``, as
   ``lmcli train`` wraps it). Each process then counts the bytes of the tensors it holds: its
   parameters (a sharded parameter's local rows), its gradients and its optimizer state; the
   row reports the larger process's parameters + optimizer state.
2. Peak memory of one training step (forward, loss, backward) of the same model on 4 × 256
   tokens in one process, with ``--activation-checkpointing`` none, full and selective: the peak
   bytes of live tensors, counted by torch's ``MemTracker`` (which counts on a CPU, where no
   allocator statistics exist), and the step's time (best of 2, without the tracker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import Row, best_time, log, run_suite
from bench.models import SMALL, lmcli_model

VOCAB, BLOCK = 65, 256
GOAL_SHARDED = 1.8  # FSDP on 2 processes: at most 1/1.8 of DDP's bytes per process (ideal: 1/2)
GOAL_FULL = 1.6  # --activation-checkpointing full: peak at most 1/1.6 of none's (weights and
# gradients, 87 MB of the 205, are not recomputed away)


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of this process's part of each tensor (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def child(kind: str) -> None:
    """Under torchrun: one AdamW step with the model wrapped as ``kind`` (ddp or fsdp), then the
    largest per-process bytes of parameters, gradients and optimizer state as JSON (rank 0)."""
    import torch.distributed as dist

    from lmcli.config.files import from_dict
    from lmcli.config.train import TrainConfig
    from lmcli.train.distributed import init_distributed, shutdown_distributed
    from lmcli.train.optim import make_optimizer
    from lmcli.train.parallel import clip_grad_norm, make_parallel

    dist_info, device = init_distributed("cpu", group=True)
    cfg = from_dict(TrainConfig, {"corpus": ["x"], "optimizer": "adamw", "parallel": kind})
    model = lmcli_model(VOCAB, BLOCK, **SMALL)
    trained = make_parallel(kind, cfg, dist_info, device, None).wrap(model, [])
    optimizer = make_optimizer(model, cfg, device)
    idx = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=torch.Generator().manual_seed(dist_info.rank))
    logits = trained(idx[:, :-1])  # (B, T, vocab)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    clip_grad_norm(list(model.parameters()), 1.0)
    optimizer.step()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    figures = torch.tensor(
        [
            _local_bytes(params),
            _local_bytes([p.grad for p in params if p.grad is not None]),
            _local_bytes(state),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if dist_info.is_main:
        keys = ("param_bytes", "grad_bytes", "optimizer_bytes")
        print(json.dumps(dict(zip(keys, figures.tolist(), strict=True))))
    shutdown_distributed()


def per_process(kind: str) -> dict[str, float]:
    """The child's figures, from 2 processes under torchrun."""
    root = Path(__file__).resolve().parents[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = [*launch, "-m", "bench.bench_fsdp", "--child", kind]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    state_mb = (result["param_bytes"] + result["optimizer_bytes"]) / 1e6
    log(f"{kind}: parameters + optimizer state {state_mb:.1f} MB per process")
    return result


def recompute_figures(mode: str) -> dict[str, Any]:
    """Peak bytes and best time of one training step with ``--activation-checkpointing mode``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from lmcli.train.activations import checkpoint_blocks

    model = lmcli_model(VOCAB, BLOCK, **SMALL)
    checkpoint_blocks(model, mode)
    idx = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(idx[:, :-1])  # (B, T, vocab)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    seconds = best_time(step, repeats=2, warmup=0)
    log(f"activation checkpointing {mode}: peak {peak / 1e6:.0f} MB, {seconds:.2f} s/step")
    return {"peak_bytes": peak, "step_s": seconds}


def run() -> list[Row]:
    fsdp, ddp = per_process("fsdp"), per_process("ddp")
    modes = {mode: recompute_figures(mode) for mode in ("none", "full", "selective")}
    state = {k: (v["param_bytes"] + v["optimizer_bytes"]) / 1e6 for k, v in (("fsdp", fsdp), ("ddp", ddp))}
    shape = "10.9M model (6 × 384, vocab 65)"
    none = modes["none"]
    rows = [
        Row(
            "FSDP params+AdamW state per process, 2 procs",
            "MB",
            state["fsdp"],
            state["ddp"],
            "DDP",
            GOAL_SHARDED,
            lower_is_better=True,
            note=f"{shape}, torchrun 2 CPU processes; gradients per process "
            f"{fsdp['grad_bytes'] / 1e6:.1f} MB (DDP {ddp['grad_bytes'] / 1e6:.1f} MB)",
            extra={"fsdp": fsdp, "ddp": ddp},
        )
    ]
    for mode, goal in (("full", GOAL_FULL), ("selective", None)):
        figures = modes[mode]
        slower = figures["step_s"] / none["step_s"]
        rows.append(
            Row(
                f"peak memory, activation checkpointing {mode}",
                "MB",
                figures["peak_bytes"] / 1e6,
                none["peak_bytes"] / 1e6,
                "none",
                goal,
                lower_is_better=True,
                note=f"{shape}, one step of 4 × 256 tokens; step time {slower:.2f}× none's "
                f"({figures['step_s']:.2f} s against {none['step_s']:.2f} s)",
                extra={"mode": figures, "none": none},
            )
        )
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        run_suite("fsdp", run)


if __name__ == "__main__":
    main()
