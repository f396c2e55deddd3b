"""Supervised examples in training: translation on the one example path gives the losses the
separate pair path gave, and a scored training step is one graph for torch.compile."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, train_config

from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.data.examples import ExampleSampler, batch_width, collate, pad_multiple
from lmcli.data.train_data import load_train_data
from lmcli.train import Reporter, train
from lmcli.train.losses import batch_loss

# Training and validation losses of the run below, recorded with lmcli at fa783b2 (main before
# this change: pairs had their own cache, sampler and collate, and the model selected the scored
# positions with a boolean mask). Causal attention, and the prefix LM.
MAIN_LOSSES = {
    False: (
        [2.647780, 2.618855, 2.573361, 2.630820, 2.525792, 2.540772]
        + [2.521822, 2.432271, 2.497335, 2.505668, 2.465469, 2.448092],
        [2.485261, 2.415010],
    ),
    True: (
        [2.648034, 2.619138, 2.573345, 2.630937, 2.525644, 2.538807]
        + [2.520221, 2.431155, 2.495118, 2.502274, 2.463132, 2.444705],
        [2.484203, 2.413544],
    ),
}


def write_pairs(tmp: Path) -> tuple[str, str]:
    """300 pairs of 1-12 letters, reversed, some targets longer: some pairs exceed the context."""
    rng = random.Random(0)
    src = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 12))) for _ in range(300)]
    (tmp / "src.txt").write_text("\n".join(src) + "\n")
    (tmp / "tgt.txt").write_text("\n".join(w[::-1] + "x" * (i % 3) for i, w in enumerate(src)) + "\n")
    return str(tmp / "src.txt"), str(tmp / "tgt.txt")


def config(tmp: Path, prefix_lm: bool, **overrides) -> TrainConfig:
    src, tgt = write_pairs(tmp)
    options = dict(
        task="translation",
        source=src,
        target=tgt,
        tokenizer="char",
        batch_size=8,
        lr=3e-3,
        warmup_steps=5,
        max_steps=12,
        log_interval=1,
        eval_interval=6,
        eval_batches=2,
        bleu_samples=0,
        prefix_lm=prefix_lm,
        label_smoothing=0.1,
        val_fraction=0.1,
        seed=0,
        out=str(tmp / f"run{int(prefix_lm)}"),
        cache_dir=str(tmp / "cache"),
    )
    return train_config(**{**options, **overrides})


SHAPE = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


@pytest.mark.parametrize("prefix_lm, padded", [(False, False), (True, False), (False, True)])
def test_translation_trains_as_it_did_before_the_examples_were_unified(
    tmp_path: Path, monkeypatch, prefix_lm: bool, padded: bool
) -> None:
    """Also with batches padded as for torch.compile (here to the context, 16): padding columns
    change no loss."""
    if padded:
        monkeypatch.setattr("lmcli.train.setup.pad_multiple", lambda compiled, device: 64)
    train(SHAPE, config(tmp_path, prefix_lm), reporter=Reporter(info=lambda m: None), progress=False)
    rows = read_metrics(tmp_path / f"run{int(prefix_lm)}")
    train_losses = [r["train_loss"] for r in rows if "train_loss" in r]
    val_losses = [r["val_loss"] for r in rows if "val_loss" in r]
    expected_train, expected_val = MAIN_LOSSES[prefix_lm]
    assert train_losses == pytest.approx(expected_train, abs=2e-6)
    assert val_losses == pytest.approx(expected_val, abs=2e-6)


def test_batches_pad_to_repeating_widths_and_index_the_scored_positions(tmp_path: Path) -> None:
    compiled = pad_multiple(True, torch.device("cpu"))
    assert compiled == pad_multiple(False, torch.device("cuda")) == 64
    assert pad_multiple(False, torch.device("cpu")) == 1  # eager on a CPU: no column wasted
    assert [batch_width(n, 512, 64) for n in (1, 64, 65, 500)] == [64, 64, 128, 512]
    assert [batch_width(n, 16, 64) for n in (3, 16)] == [16, 16]
    assert batch_width(70, 100, 64) == 100  # never wider than the context
    assert batch_width(70, 100, 1) == 70
    data = load_train_data(config(tmp_path, False), block_size=100, progress=False)
    batch = collate(data.train, list(range(8)), data.tokenizer.pad_id, 100, compiled)
    assert batch.x.size(1) == 64 and batch.index is not None
    assert torch.equal(batch.index, (batch.y.view(-1) != -100).nonzero().squeeze(1))
    longest = max(int(n) for n in data.train.length[:8]) - 1
    assert collate(data.train, list(range(8)), data.tokenizer.pad_id, 100).x.size(1) == longest


def test_a_scored_training_step_is_one_graph_without_breaks(tmp_path: Path) -> None:
    """Boolean-mask selection broke the graph (aten.nonzero) and synced; gathering by index does not."""
    cfg = config(tmp_path, False)
    data = load_train_data(cfg, block_size=16, progress=False)
    from lmcli.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=data.tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=16)
    )
    batch = ExampleSampler(
        data.train, 8, 0, data.tokenizer.pad_id, 16, pad_multiple(True, torch.device("cpu"))
    ).batch(0, 8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda b: batch_loss(model, b, cfg))(batch)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
