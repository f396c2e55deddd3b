"""Activation checkpointing (``--activation-checkpointing``): the same losses and gradients as
keeping every activation, with less kept for the backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_TEXT, assert_same_weights, read_metrics, tiny_model, train_config, weights

from lmcli.config.model import ModelConfig
from lmcli.train import Reporter, train
from lmcli.train.activations import checkpoint_blocks
from lmcli.train.preflight import estimate_memory

MODES = ("none", "full", "selective")


def loss_grads_and_peak(mode: str, **shape) -> tuple[torch.Tensor, dict, int]:
    """One forward and backward of a seeded tiny model under ``mode``: the loss, every gradient,
    and the peak bytes of tensors alive (torch's ``MemTracker``, which counts on the CPU too)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = tiny_model(vocab_size=40, seed=3, n_layer=4, block_size=64, n_embd=64, **shape)
    model.train()
    checkpoint_blocks(model, mode)
    idx = torch.randint(0, 40, (8, 64), generator=torch.Generator().manual_seed(1))
    tracker = MemTracker()
    tracker.track_external(model)
    torch.manual_seed(0)  # dropout's masks: replayed by the recomputation
    with tracker:
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("shape", [{}, {"dropout": 0.2, "mlp": "swiglu", "norm": "rmsnorm"}])
def test_recomputing_gives_the_same_loss_and_gradients_and_keeps_less(shape: dict) -> None:
    results = {mode: loss_grads_and_peak(mode, **shape) for mode in MODES}
    loss, grads, peak = results["none"]
    for mode in ("full", "selective"):
        other_loss, other_grads, _ = results[mode]
        assert torch.equal(other_loss, loss), mode
        for name, g in grads.items():
            assert torch.equal(other_grads[name], g), f"{mode}: {name}"
    assert results["full"][2] < results["selective"][2] < 0.9 * peak, "each mode keeps less"


def test_training_with_activation_checkpointing_takes_the_same_steps(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT)
    model = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    runs = {}
    for mode in ("none", "selective"):
        cfg = train_config(
            corpus=(str(corpus),),
            out=str(tmp_path / mode),
            batch_size=4,
            max_steps=8,
            log_interval=1,
            eval_interval=8,
            eval_batches=1,
            activation_checkpointing=mode,
        )
        runs[mode] = train(model, cfg, reporter=Reporter(info=lambda m: None), progress=False).run_dir
    losses = [[r["train_loss"] for r in read_metrics(run) if "train_loss" in r] for run in runs.values()]
    assert losses[0] == losses[1] and len(losses[0]) == 8
    assert_same_weights(weights(runs["none"]), weights(runs["selective"]))


def test_the_memory_estimate_shrinks_with_recomputation_and_shards() -> None:
    cfg = ModelConfig(vocab_size=1000, block_size=256, n_layer=8, n_head=8, n_embd=512)
    params = 30_000_000
    figures = {mode: estimate_memory(cfg, params, 8, False, recompute=mode) for mode in MODES}
    assert figures["full"] < figures["selective"] < figures["none"]
    whole = estimate_memory(cfg, params, 8, False)
    halves = estimate_memory(cfg, params, 8, False, shards=2)
    state = params * 16  # weights, gradients and two AdamW moments, float32
    assert whole - halves == pytest.approx(state / 2, rel=0.2), "about half the state per process"


def test_the_memory_estimate_counts_the_heads_at_their_width() -> None:
    """Grouped key/value heads and a free head size change what a block keeps for the backward:
    queries, keys, values and the attention's output at their own widths, not the model's."""
    base = dict(vocab_size=1000, block_size=256, n_layer=8, n_head=8, n_embd=512)
    params, B, T = 30_000_000, 8, 256

    def estimate(**shape) -> int:
        return estimate_memory(ModelConfig(**{**base, **shape}), params, B, False)

    mha, gqa, wide = estimate(), estimate(n_kv_head=2), estimate(head_size=128)
    # float32 activations: 4 bytes a value; keys and values 2 x 2 values a column each
    assert mha - gqa == 8 * B * T * 4 * (512 - 2 * 64) * 2
    assert wide - mha == 8 * B * T * 4 * (2 * 1024 - 2 * 512) * 2  # queries, output, keys, values
