"""Training throughput: lmcli's training step against Hugging Face GPT-2 on the same weights,
and lmcli's achieved FLOP/s against this machine's measured fp32 matmul peak.

One step is what ``lmcli train`` does per optimizer step: ``forward_scored``, cross-entropy,
backward, gradient clipping, AdamW from ``make_optimizer``, zero_grad. The Hugging Face side
does the same with ``GPT2LMHeadModel`` (SDPA attention, dropouts 0) and the same optimizer.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import Row, interleaved, log, run_suite
from bench.models import SMALL, check_same_logits, hf_twin, lmcli_model
from lmcli.config.files import from_dict
from lmcli.config.train import TrainConfig
from lmcli.data.windows import Batch, WindowSampler
from lmcli.train.losses import forward_scored
from lmcli.train.optim import make_optimizer

VOCAB, BLOCK, BATCH = 65, 256, 8
STEPS_PER_TIMING = 1  # optimizer steps per timed call
GOAL_VS_HF, GOAL_OF_PEAK = 1.3, 0.6


def matmul_peak(sizes: tuple[int, ...] = (2048,), repeats: int = 3) -> float:
    """Best fp32 GFLOP/s of large square matmuls (2 n^3 FLOPs each) on all threads."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def flops_per_token(n_matmul_params: int, n_layer: int, block: int, n_embd: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward through the weights) plus attention
    12 L T C (the QK^T and AV products, forward and backward, as in PaLM / nanoGPT)."""
    return 6 * n_matmul_params + 12 * n_layer * block * n_embd


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig) -> None:
    """One lmcli training step (language modelling, float32, no accumulation)."""
    logits, targets = forward_scored(model, batch)
    loss = F.cross_entropy(logits.float(), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_train_step(hf: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig) -> None:
    """The same step on the Hugging Face model: logits at every position, the same loss."""
    logits = hf(input_ids=batch.x).logits
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), batch.y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def run() -> list[Row]:
    device = torch.device("cpu")
    # the same optimizer on both sides
    cfg = from_dict(TrainConfig, {"batch_size": BATCH, "warmup_steps": 0, "optimizer": "adamw"})
    model = lmcli_model(VOCAB, BLOCK, **SMALL).train()
    hf = hf_twin(model).train()
    check_same_logits(model, hf, VOCAB)
    opt, hf_opt = make_optimizer(model, cfg, device), make_optimizer(hf, cfg, device)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=200_000).astype(np.uint16)
    sampler = WindowSampler(tokens, BLOCK, seed=0)
    batches = [sampler.batch(i * BATCH, BATCH) for i in range(STEPS_PER_TIMING)]

    def ours() -> None:
        for b in batches:
            train_step(model, opt, b, cfg)

    def theirs() -> None:
        for b in batches:
            hf_train_step(hf, hf_opt, b, cfg)

    peaks: list[float] = []

    def peak() -> None:
        peaks.append(matmul_peak())

    n_params = model.num_parameters()
    log(f"model: {n_params / 1e6:.2f}M parameters, batch {BATCH} x {BLOCK}; timing steps and matmuls")
    # the matmul peak is measured in turn with the steps, so both see the same machine load
    times = interleaved({"lmcli": ours, "hf": theirs, "peak": peak}, repeats=4, warmup=1)
    peak = max(peaks)
    tokens_per_call = STEPS_PER_TIMING * BATCH * BLOCK
    tps = {k: tokens_per_call / times[k] for k in ("lmcli", "hf")}
    n_matmul = n_params - sum(p.numel() for p in model.positions.parameters())  # lookups, not matmuls
    fpt = flops_per_token(n_matmul, model.config.n_layer, BLOCK, model.config.n_embd)
    achieved = tps["lmcli"] * fpt / 1e9
    hf_achieved = tps["hf"] * fpt / 1e9
    ceiling = peak / hf_achieved  # the best ratio any implementation of the same FLOPs could reach
    formula = "6*N + 12*L*T*C per token, N = parameters minus position embeddings"
    return [
        Row(
            f"train tokens/s, {n_params / 1e6:.1f}M, {BATCH}x{BLOCK}",
            "tokens/s",
            tps["lmcli"],
            tps["hf"],
            "HF GPT2LMHeadModel sdpa",
            GOAL_VS_HF,
            note=f"HF runs at {hf_achieved / peak:.0%} of the matmul peak, so a step doing the same FLOPs "
            f"entirely at the peak would be {ceiling:.2f}x HF",
            extra={
                "params": n_params,
                "step_s": {k: times[k] / STEPS_PER_TIMING for k in ("lmcli", "hf")},
                "ceiling_at_peak": ceiling,
            },
        ),
        Row(
            "train GFLOP/s vs fp32 matmul peak",
            "GFLOP/s",
            achieved,
            peak,
            "torch.mm peak",
            GOAL_OF_PEAK,
            extra={
                "flops_per_token": fpt,
                "formula": formula,
                "hf_gflops": hf_achieved,
            },
        ),
    ]


def main() -> None:
    run_suite("train", run)


if __name__ == "__main__":
    main()
