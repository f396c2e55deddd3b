"""Decoder-only translation: a tiny model learns a synthetic task exactly; bad input errors."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, run_cli, train_config

from lmcli.cli.app import main
from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.sources import load_checkpoint
from lmcli.train import Reporter, train

LETTERS = "abcdefgh"


def words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 6))) for _ in range(n)]


def write_task(tmp: Path) -> tuple[str, str]:
    src = words(2000, 0)
    (tmp / "src.txt").write_text("\n".join(src) + "\n")
    (tmp / "tgt.txt").write_text("\n".join(w[::-1] for w in src) + "\n")
    return str(tmp / "src.txt"), str(tmp / "tgt.txt")


def train_reversal(tmp: Path, out: str, **overrides):
    """Train a 2-layer model on the word-reversal task; ``overrides`` change the TrainConfig."""
    src, tgt = write_task(tmp)
    options = dict(
        task="translation",
        source=src,
        target=tgt,
        tokenizer="char",
        batch_size=32,
        lr=3e-3,
        warmup_steps=20,
        out=str(tmp / out),
    )
    cfg = train_config(**{**options, **overrides})
    model = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=16)
    return train(model, cfg, reporter=Reporter(info=lambda m: None), progress=False)


def greedy(run: Path, word: str) -> str:
    ckpt = load_checkpoint(run)
    tok, model = ckpt.tokenizer, ckpt.model
    ids = [tok.bos_id, *tok.encode(word), tok.sep_id]
    start = len(ids)
    with torch.no_grad():
        while len(ids) < start + 10:
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            if nxt == tok.eos_id:
                break
            ids.append(nxt)
    return tok.decode(ids[start:])


@pytest.mark.slow
def test_a_small_model_learns_to_reverse_words_exactly(tmp_path: Path) -> None:
    result = train_reversal(tmp_path, "run", max_steps=800, eval_interval=400, bleu_samples=50)
    assert result.best_val_loss < 0.05  # target-only loss, nats per target token
    held_out = [w for w in words(40, 99) if w not in set(words(2000, 0))]
    assert len(held_out) >= 10
    assert all(greedy(tmp_path / "run", w) == w[::-1] for w in held_out)
    # greedy decoding of validation pairs, scored at every validation (one-word lines: chrF)
    scored = [r for r in read_metrics(tmp_path / "run") if "val_bleu" in r]
    assert [r["step"] for r in scored] == [400, 800]
    assert scored[0]["val_chrf"] < scored[-1]["val_chrf"] and scored[-1]["val_chrf"] > 95
    # `lmcli beam` translates a .gz file: one line per input line, in order, empty lines kept
    inputs = [held_out[0], "", held_out[1], held_out[2], ""]
    with gzip.open(tmp_path / "in.txt.gz", "wt") as f:
        f.write("\n".join(inputs) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(w[::-1] for w in inputs) + "\n")
    out = tmp_path / "hyp.txt"
    argv = ["beam", str(tmp_path / "run"), "-i", str(tmp_path / "in.txt.gz"), "-o", str(out)]
    main(
        [
            *argv,
            "--reference",
            str(tmp_path / "ref.txt"),
            "--beam-size",
            "3",
            "--max-len-a",
            "1",
            "--max-len-b",
            "2",
        ]
    )
    assert out.read_text().split("\n") == [*(w[::-1] for w in inputs), ""]


def test_label_smoothing_changes_the_training_loss_not_the_validation_loss(tmp_path: Path) -> None:
    losses = {}
    for smoothing in (0.0, 0.3):
        train_reversal(
            tmp_path,
            f"run-{smoothing}",
            max_steps=150,
            eval_interval=150,
            label_smoothing=smoothing,
            bleu_samples=0,
        )
        records = read_metrics(tmp_path / f"run-{smoothing}")
        assert not any("val_bleu" in r for r in records)  # --bleu-samples 0: no decoding
        last = {k: v for r in records if r["step"] == 150 for k, v in r.items()}
        losses[smoothing] = (last["train_loss"], last["val_loss"])
    (plain_train, plain_val), (smooth_train, smooth_val) = losses[0.0], losses[0.3]
    # a smoothed loss keeps a floor of 0.3 x the cross-entropy to the uniform distribution
    assert smooth_train - smooth_val > 0.3
    assert abs(plain_train - plain_val) < 0.2
    assert abs(smooth_val - plain_val) < 0.5  # both validation losses are plain NLL


def test_prefix_lm_trains(tmp_path: Path) -> None:
    result = train_reversal(tmp_path, "run", max_steps=200, eval_interval=100, prefix_lm=True)
    assert result.best_val_loss < 1.0  # far below uniform over 8 letters + <eos> (2.2 nats)
    assert load_checkpoint(tmp_path / "run").train_config.translation.prefix_lm


def test_line_count_mismatch_is_one_line_naming_both_counts(tmp_path: Path, capsys) -> None:
    (tmp_path / "s.txt").write_text("a\nb\nc\n")
    (tmp_path / "t.txt").write_text("a\nb\n")
    code, _, err = run_cli(
        [
            "train",
            "--task",
            "translation",
            "--source",
            str(tmp_path / "s.txt"),
            "--target",
            str(tmp_path / "t.txt"),
            "--out",
            str(tmp_path / "run"),
        ],
        capsys,
    )
    assert code == 2 and err.count("\n") == 1
    assert "has 3 lines" in err and "has 2" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(source="s.txt", target="t.txt"), "need --task translation"),
        (dict(task="translation", source="s.txt"), "give both --source and --target"),
        (dict(task="translate"), "invalid task"),
    ],
)
def test_translation_option_errors(kw: dict, message: str) -> None:
    with pytest.raises(LmcliError, match=message):
        train_config(**kw)


@pytest.mark.parametrize("select", [None, "val_chrf", "val_loss"])
def test_best_follows_the_selected_metric_bleu_by_default(tmp_path: Path, select: str | None) -> None:
    """best/ is the checkpoint of the validation with the highest --select score (greedy BLEU by
    default for translation; equal scores: the lower loss; with val_loss, the lowest loss)."""
    options = {} if select is None else {"select": select}
    train_reversal(tmp_path, "run", max_steps=90, eval_interval=30, bleu_samples=20, **options)
    scored = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    key = select or "val_bleu"
    sign = 1 if key == "val_loss" else -1
    best = min(scored, key=lambda r: (sign * r[key], r["val_loss"]))
    assert load_checkpoint(tmp_path / "run" / "best").meta["step"] == best["step"]
    assert load_checkpoint(tmp_path / "run").train_config.selected_metric == key


def test_select_bleu_needs_translation_with_bleu_samples() -> None:
    with pytest.raises(LmcliError, match="--select val_bleu needs --task translation and --bleu-samples"):
        train_config(select="val_bleu")
    with pytest.raises(LmcliError, match="--select val_chrf needs"):
        train_config(task="translation", source="s", target="t", bleu_samples=0, select="val_chrf")
