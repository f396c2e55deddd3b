"""LoRA: a pretrained tiny model fine-tuned on a shifted corpus, fully and with adapters.

One base model (pretrained on sentences "the N V on the N.") is shared by the module; the
fine-tuning corpus keeps the grammar but shifts which nouns go where, so the base is clearly
worse on it than a fine-tuned model, and the shift is the kind LoRA is for.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_float32_close,
    assert_one_line_error,
    kill_after_checkpoint,
    run_cli,
    saved_step,
    train_config,
)
from safetensors.torch import load_file

from lmcli.cli.app import main
from lmcli.config.model import ModelConfig
from lmcli.formats.checkpoint import ADAPTERS, save_checkpoint
from lmcli.formats.sources import load_checkpoint, load_model
from lmcli.model.lora import has_adapters
from lmcli.train import Reporter, train

NOUNS = ["cat", "dog", "mat", "log", "bird", "tree", "sun", "hill"]
VERBS = ["sat", "sang", "rose"]
QUIET = Reporter(info=lambda msg: None)
COMMON = dict(batch_size=8, eval_interval=1000, eval_batches=4, warmup_steps=5, seed=1)
LORA = dict(lora_rank=2, lora_alpha=4.0, lora_targets="qkv,attn_out")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the pretrained base run (``base``) and the corpora ``a.txt`` and ``b.txt``."""
    tmp = tmp_path_factory.mktemp("lora")
    rng = random.Random(0)
    a = "".join(
        f"the {rng.choice(NOUNS)} {rng.choice(VERBS)} on the {rng.choice(NOUNS)}.\n" for _ in range(150)
    )
    b = "".join(
        f"the {rng.choice(NOUNS[:4])} {rng.choice(VERBS)} on the {rng.choice(NOUNS[4:])}.\n"
        for _ in range(150)
    )
    (tmp / "a.txt").write_text(a)
    (tmp / "b.txt").write_text(b)
    model = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)
    cfg = train_config(
        corpus=(str(tmp / "a.txt"),),
        out=str(tmp / "base"),
        cache_dir=str(tmp / "cache"),
        max_steps=200,
        lr=5e-3,
        optimizer="adamw",  # the base these fine-tuning figures were calibrated on
        schedule="cosine",
        **COMMON,
    )
    train(model, cfg, reporter=QUIET, progress=False)
    return tmp


def fine_tune(tmp: Path, name: str, **options) -> float:
    """Fine-tune the base on ``b.txt`` into ``tmp/name``; the final validation loss."""
    cfg = train_config(
        corpus=(str(tmp / "b.txt"),),
        out=str(tmp / name),
        init_from=str(tmp / "base"),
        cache_dir=str(tmp / "cache"),
        **{"max_steps": 60, **COMMON, **options},
    )
    result = train(ModelConfig(), cfg, reporter=QUIET, progress=False)
    assert result.val_loss is not None
    return result.val_loss


@pytest.fixture(scope="module")
def lora_run(base: Path) -> tuple[Path, float]:
    return base / "lora", fine_tune(base, "lora", lr=2e-2, **LORA)


@pytest.mark.slow
def test_lora_gets_within_10_percent_of_full_fine_tuning_training_only_the_adapters(
    base: Path, lora_run: tuple[Path, float]
) -> None:
    run, lora_loss = lora_run
    full_loss = fine_tune(base, "full", lr=3e-3)
    untuned_loss = fine_tune(base, "untuned", lr=1e-9, max_steps=1)
    print(f"validation loss: not fine-tuned {untuned_loss:.4f}, full {full_loss:.4f}, LoRA {lora_loss:.4f}")
    assert untuned_loss > 1.15 * full_loss, (untuned_loss, full_loss)  # the shift needs fine-tuning
    assert lora_loss <= 1.10 * full_loss, (lora_loss, full_loss)
    # the adapters file is small beside the base, which the run left as it was
    base_file = base / "base" / "best" / "model.safetensors"
    assert (run / "last" / ADAPTERS).stat().st_size <= 0.02 * base_file.stat().st_size
    assert not (run / "last" / "model.safetensors").exists()
    reference = json.loads((run / "last" / "base.json").read_text())
    assert reference["path"] == str((base / "base" / "best").resolve())
    recorded = json.loads((base / "base" / "best" / "meta.json").read_text())["sha256"]["model.safetensors"]
    assert reference["sha256"] == {"model.safetensors": recorded}
    # the optimizer held state for the 8 adapter matrices only (2 layers x 2 targets x A, B)
    lora_state = torch.load(run / "last" / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    full_state = torch.load(base / "full" / "last" / "trainer_state.pt", weights_only=True)["optimizer"][
        "state"
    ]
    assert len(lora_state) == 8 and len(full_state) > 20
    assert sorted(load_file(str(run / "last" / ADAPTERS))) == sorted(
        f"h.{i}.attn.{layer}.lora_{ab}" for i in range(2) for layer in ("c_attn", "c_proj") for ab in "ab"
    )


@pytest.mark.slow
def test_merged_export_gives_the_logits_of_base_plus_adapters(
    lora_run: tuple[Path, float], tmp_path: Path, capsys
) -> None:
    run, _ = lora_run
    adapted = load_checkpoint(run, merge=False).model  # base + adapters, unmerged
    assert has_adapters(adapted)
    idx = torch.randint(0, adapted.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(idx)
        base_logits = load_model(run.parent / "base").model(idx)
    assert (expected - base_logits).abs().max() > 1e-2  # the adapters changed something
    code, _, err = run_cli(
        ["export", "--merge", str(run), "--format", "lmcli", str(tmp_path / "plain")], capsys
    )
    assert code == 0, err
    code, _, err = run_cli(["export", "--merge", str(run), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    for folder in (run, tmp_path / "plain", tmp_path / "hf"):  # load_model merges a LoRA run
        model = load_model(folder).model
        assert not has_adapters(model)
        with torch.no_grad():
            assert_float32_close(model(idx), expected, model.config)  # merged weights: other sums
    assert (tmp_path / "plain" / "model.safetensors").exists()
    code, out, err = run_cli(["sample", str(run), "--prompt", "the ", "--max-new-tokens", "8"], capsys)
    assert code == 0 and out.startswith("the "), err


@pytest.mark.slow
def test_lora_resume_after_sigkill_is_bit_identical(base: Path, tmp_path: Path) -> None:
    # each run is `lmcli train` (lmcli.cli.app.main) forked from a server that imported torch once
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lmcli.cli.app", "lmcli.train.loop", "lmcli.train.display"])
    args = [
        *(str(base / "b.txt"), "--init-from", str(base / "base"), "--cache-dir", str(base / "cache")),
        *("--lora-rank", "2", "--lora-dropout", "0.1", "--lr", "1e-2", "--max-steps", "40"),
        *("--batch-size", "8", "--eval-interval", "4", "--eval-batches", "1", "--warmup-steps", "5", "-q"),
    ]
    full = ctx.Process(target=main, args=(["train", *args, "--out", str(tmp_path / "full")],))
    full.start()
    full.join(120)
    assert full.exitcode == 0
    killed = ctx.Process(target=main, args=(["train", *args, "--out", str(tmp_path / "killed")],))
    killed.start()
    kill_after_checkpoint(killed, tmp_path / "killed", 8)
    assert killed.exitcode == -signal.SIGKILL
    assert 8 <= saved_step(tmp_path / "killed") < 40, "killed before the end"
    resumed = ctx.Process(target=main, args=(["train", "--resume", str(tmp_path / "killed"), "-q"],))
    resumed.start()
    resumed.join(120)
    assert resumed.exitcode == 0
    a = load_file(str(tmp_path / "full" / "last" / ADAPTERS))
    b = load_file(str(tmp_path / "killed" / "last" / ADAPTERS))
    assert a.keys() == b.keys() and len(a) == 16  # qkv, attn_out, fc, mlp_out: the default targets
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.mark.slow
def test_bad_lora_inputs_are_one_line(base: Path, tmp_path: Path, capsys) -> None:
    train_args = [str(base / "b.txt"), "--cache-dir", str(base / "cache"), "--max-steps", "2", "-q"]
    own_base = tmp_path / "own-base"
    shutil.copytree(base / "base", own_base)
    adapt = [*train_args, "--init-from", str(own_base), "--lora-rank", "2"]

    code, _, err = run_cli(["train", *adapt, "--lora-targets", "qkv,attn", "-o", str(tmp_path / "x")], capsys)
    assert_one_line_error(code, err, "lora-targets: 'attn' names no layer: choose from qkv, attn_out")
    code, _, err = run_cli(["train", *adapt, "--lora-targets", "gate", "-o", str(tmp_path / "x")], capsys)
    assert_one_line_error(code, err, "lora target gate names no layer of this model")
    assert not (tmp_path / "x").exists()  # nothing left behind
    code, _, err = run_cli(["train", *train_args, "--lora-rank", "2", "-o", str(tmp_path / "x")], capsys)
    assert_one_line_error(code, err, "--lora-rank needs --init-from")
    code, _, err = run_cli(["train", *adapt, "--ema", "0.99", "-o", str(tmp_path / "x")], capsys)
    assert_one_line_error(code, err, "--ema averages full weights: it cannot be combined with --lora-rank")
    assert not (tmp_path / "x").exists()

    run = tmp_path / "lora"
    code, _, err = run_cli(["train", *adapt, "-o", str(run)], capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", *adapt, "--init-from", str(run), "-o", str(tmp_path / "x")], capsys)
    assert_one_line_error(code, err, "is itself a LoRA run: fold its adapters first")
    code, _, err = run_cli(["export", str(run), str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, "is a LoRA run: give --merge")
    code, _, err = run_cli(["export", "--merge", str(own_base), str(tmp_path / "hf")], capsys)
    assert_one_line_error(code, err, "has no LoRA adapters to fold")

    # the base is saved anew (other weights): every command that loads the LoRA run refuses it
    ckpt = load_checkpoint(own_base / "best")
    with torch.no_grad():
        ckpt.model.wte.weight.mul_(1.01)
    save_checkpoint(own_base / "best", ckpt.model, ckpt.train_config, ckpt.tokenizer, meta=ckpt.meta)
    for argv in (
        ["sample", str(run), "--max-new-tokens", "2"],
        ["eval", str(run), str(base / "b.txt")],
        ["export", "--merge", str(run), str(tmp_path / "hf")],
        ["train", "--resume", str(run), "--max-steps", "4", "-q"],
        ["verify", str(run)],
    ):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, f"the base model {own_base / 'best'} changed since LoRA run")
    shutil.rmtree(own_base)
    code, _, err = run_cli(["sample", str(run), "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, f"the base model {own_base / 'best'} of LoRA run")


def test_decoding_with_adapters_on_equals_the_merged_model_on_the_fast_path() -> None:
    """While adapters are on (validation and BLEU during training) the CPU fast step, which reads
    plain weights, steps aside; the merged model decodes on it, to the same tokens."""
    import copy

    from helpers import tiny_model, tiny_tokenizer

    from lmcli.config.commands import SampleConfig
    from lmcli.generate.sampling import generate
    from lmcli.model import fastpath
    from lmcli.model.lora import add_adapters, merge

    tok = tiny_tokenizer()
    model = add_adapters(tiny_model(tok.vocab_size), train_config(init_from="base", lora_rank=2)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    merged = merge(copy.deepcopy(model))
    with fastpath.inference(model):
        assert model.fast_step is None
    cfg = SampleConfig(temperature=0.0, max_new_tokens=24)
    prompts = [tok.encode("the cat"), tok.encode("a bird")]
    adapted_out = [g.ids for g in generate(model, tok, prompts, cfg)]
    with fastpath.inference(merged):
        assert merged.fast_step is not None
        merged_out = [g.ids for g in generate(merged, tok, prompts, cfg)]
    assert adapted_out == merged_out


def test_lora_on_a_padded_base_trains_its_embeddings_and_merges_to_the_logical_vocabulary(
    tmp_path: Path, capsys
) -> None:
    """A base whose 25-token vocabulary is padded to 64 rows: LoRA with --lora-train-embeddings
    keeps the padded table (the base's layout), and `export --merge` gives an lmcli checkpoint
    with the padding and a Hugging Face folder with the 25 rows, both with the adapted logits."""
    from helpers import TINY_TEXT, make_run

    base = make_run(tmp_path / "base", vocab_multiple=64)
    (tmp_path / "corpus.txt").write_text(TINY_TEXT)
    cfg = train_config(
        corpus=(str(tmp_path / "corpus.txt"),),
        out=str(tmp_path / "lora"),
        init_from=str(base),
        lora_train_embeddings=True,
        **{**COMMON, **LORA, "max_steps": 4, "lr": 1e-2},
    )
    run = train(ModelConfig(), cfg, reporter=QUIET, progress=False).run_dir
    assert load_file(str(run / "last" / ADAPTERS))["wte.weight"].shape == (64, 32)
    adapted = load_checkpoint(run, merge=False).model
    idx = torch.randint(0, 25, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted(idx)
    assert expected.shape == (2, 16, 25)
    for fmt in ("lmcli", "hf"):
        code, _, err = run_cli(["export", "--merge", str(run), "--format", fmt, str(tmp_path / fmt)], capsys)
        assert code == 0, err
    assert load_file(str(tmp_path / "lmcli" / "model.safetensors"))["wte.weight"].shape == (64, 32)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["vocab_size"] == 25
    assert load_file(str(tmp_path / "hf" / "model.safetensors"))["transformer.wte.weight"].shape == (25, 32)
    for folder in (tmp_path / "lmcli", tmp_path / "hf"):
        with torch.no_grad():
            model = load_model(folder).model
            assert_float32_close(model(idx), expected, model.config)  # merged weights: other sums
