"""What a real pretrained model exposes (issue 28): ``sample --chat`` and the warning when a
model ends at once; an imported model's ``--block-size`` applied and stored; the pre-flight of
an imported model (memory from the context actually used, MFU of a LoRA run, tokens/s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_TEXT,
    assert_one_line_error,
    make_run,
    run_cli,
    tiny_model,
    tiny_tokenizer,
    train_config,
)

from lmcli.config.commands import SampleConfig
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.sources import load_checkpoint, load_model
from lmcli.generate.sampling import generate
from lmcli.text import chat_template
from lmcli.train import Reporter, train
from lmcli.train.mfu import flops_per_token, matmul_params
from lmcli.train.preflight import estimate_memory, fmt_rate

pytest.importorskip("transformers")
from families import VARIANTS, hf_folder  # noqa: E402

# ----------------------------------------------------------------------------- sample --chat


def test_sample_chat_applies_the_models_chat_template(tmp_path: Path, capsys) -> None:
    folder = hf_folder(tmp_path, "qwen2-gqa-bias-yarn")  # a folder with a chat template
    argv = ["sample", str(folder), "-p", "the cat", "--temperature", "0", "--max-new-tokens", "5"]
    code, out, err = run_cli([*argv, "--chat", "--json"], capsys)
    assert code == 0, err
    ckpt = load_model(folder)
    template = chat_template.template_of(ckpt)
    prompt = chat_template.encode([{"role": "user", "content": "the cat"}], template, ckpt.tokenizer)
    assert ckpt.tokenizer.decode(prompt, skip_special_tokens=False) == "<|im_start|>the cat<|im_end|>"
    expected = generate(ckpt.model, ckpt.tokenizer, [prompt], SampleConfig(temperature=0, max_new_tokens=5))[
        0
    ]
    assert json.loads(out)["tokens"] == expected.ids
    code, out, _ = run_cli([*argv, "--chat"], capsys)  # the reply alone, not the prompt before it
    assert code == 0 and out == expected.text + "\n"


def test_sample_chat_of_a_translation_model_is_one_line(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "run", kind="bpe")
    ckpt = load_checkpoint(run)
    save_checkpoint(
        run / "last", ckpt.model, TrainConfig(task="translation"), ckpt.tokenizer, meta={"step": 0}
    )
    code, _, err = run_cli(["sample", str(run / "last"), "-p", "x", "--chat"], capsys)
    assert_one_line_error(code, err, "this is a translation model: --chat does not apply")


def test_a_model_that_ends_at_once_is_reported(tmp_path: Path, capsys) -> None:
    """A model whose first token is always its end prints nothing: a warning says so, and how an
    instruct model is asked."""
    tok = tiny_tokenizer()
    model = tiny_model(tok.vocab_size)
    with torch.no_grad():  # every position's hidden state is the final norm's bias: <eos> wins
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.wte.weight[tok.eos_id] = 1.0
    save_checkpoint(tmp_path / "run" / "last", model, TrainConfig(), tok, meta={"step": 0})
    code, out, err = run_cli(["sample", str(tmp_path / "run"), "-p", "the", "--num-samples", "2"], capsys)
    assert code == 0 and "(eos)" in out
    assert "warning: 2 sample(s) ended at once" in err and "--chat" in err
    code, _, err = run_cli(["sample", str(tmp_path / "run"), "-p", "the", "--chat"], capsys)
    assert "warning: 1 sample(s) ended at once" in err and "--chat" not in err


# ----------------------------------------------------------------------------- --block-size


def train_from(folder: Path, tmp: Path, capsys, *extra: str) -> Path:
    (tmp / "c.txt").write_text(TINY_TEXT)
    run = tmp / f"ft{len(list(tmp.glob('ft*')))}"
    argv = [
        *("train", str(tmp / "c.txt"), "--init-from", str(folder), "-o", str(run), "-q"),
        *("--max-steps", "2", "--batch-size", "2", "--cache-dir", str(tmp / "cache")),
        *("--eval-interval", "2", "--eval-batches", "1", *extra),
    ]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    return run


def stored_block(run: Path) -> int:
    return json.loads((run / "last" / "config.json").read_text())["model"]["block_size"]


def test_block_size_below_an_imported_context_is_applied_and_stored(tmp_path: Path, capsys) -> None:
    folder = hf_folder(tmp_path, "llama-tied")  # a context of 64 tokens
    assert stored_block(train_from(folder, tmp_path, capsys)) == 64  # not given: the model's own
    run = train_from(folder, tmp_path, capsys, "--block-size", "16")
    assert stored_block(run) == 16 and load_model(run).model.config.block_size == 16
    code, out, err = run_cli(["sample", str(run), "-p", "the", "--max-new-tokens", "30"], capsys)
    assert code == 0, err  # decodes past its 16 tokens by sliding, as any 16-token model
    lora = train_from(folder, tmp_path, capsys, "--block-size", "16", "--lora-rank", "2")
    assert stored_block(lora) == 16 and load_model(lora).model.config.block_size == 16  # the base is cut too


def test_block_size_above_an_imported_context_keeps_the_models(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, "llama-tied")
    notes: list[str] = []
    _, ckpt = preflight_of(folder, tmp_path, ModelConfig(block_size=128), notes=notes)
    assert ckpt.model_config.block_size == 64
    assert any("has a context of 64 tokens: block size 64, not 128" in n for n in notes)


# ----------------------------------------------------------------------------- the pre-flight


def preflight_of(
    folder: Path, tmp: Path, model_config: ModelConfig, notes: list[str] | None = None, **options: object
):
    """A one-step run ``--init-from folder``: its pre-flight figures and its last checkpoint."""
    (tmp / "c.txt").write_text(TINY_TEXT * 120)
    seen = {}
    cfg = train_config(
        corpus=(str(tmp / "c.txt"),),
        init_from=str(folder),
        out=str(tmp / f"ft{len(list(tmp.glob('ft*')))}"),
        cache_dir=str(tmp / "cache"),
        max_steps=1,
        eval_interval=1,
        eval_batches=1,
        batch_size=2,
        **options,
    )
    info = notes.append if notes is not None else (lambda m: None)
    rep = Reporter(info=info, preflight=lambda pre, facts: seen.update(pre=pre, facts=facts))
    train(model_config, cfg, reporter=rep, progress=False)
    return seen["pre"], load_checkpoint(cfg.out)


def test_preflight_memory_follows_the_context_actually_used(tmp_path: Path, monkeypatch) -> None:
    """An imported model with a long context (1,024 tokens here) trained with --block-size 32:
    the estimate is the one of a 32-token model, far below the full context's."""
    cls, fields, specials, roles, extra = VARIANTS["llama-tied"]
    monkeypatch.setitem(
        VARIANTS, "llama-long", (cls, {**fields, "max_position_embeddings": 1024}, specials, roles, extra)
    )
    folder = hf_folder(tmp_path, "llama-long")
    pre, ckpt = preflight_of(folder, tmp_path, ModelConfig(block_size=32))
    cfg = ckpt.model_config
    assert cfg.block_size == 32
    params = ckpt.model.num_parameters()
    assert pre.memory_bytes == estimate_memory(cfg, params, 2, False)
    full = estimate_memory(ModelConfig(**{**cfg.__dict__, "block_size": 1024}), params, 2, False)
    assert pre.memory_bytes * 20 < full


def test_lora_mfu_counts_no_weight_gradient_of_the_frozen_base(tmp_path: Path) -> None:
    """MFU's FLOPs per token of a LoRA run: 4 N + 2 (what trains) + attention, not 6 N."""
    folder = hf_folder(tmp_path, "llama-tied")
    _, ckpt = preflight_of(folder, tmp_path, ModelConfig(), lora_rank=2, peak_tflops=1.0)
    metrics = (Path(ckpt.path).parent / "metrics.jsonl").read_text()
    record = next(r for r in map(json.loads, metrics.splitlines()) if r.get("mfu") is not None)
    per_token = record["mfu"] * 1e12 / record["tokens_per_s"]  # against a peak of 1 TFLOP/s
    model = load_checkpoint(ckpt.path, merge=False).model  # the base with its adapters
    n, trained = matmul_params(model), matmul_params(model, trained_only=True)
    assert 0 < trained < n / 10
    cfg = model.config
    assert per_token == pytest.approx(flops_per_token(cfg, n, cfg.block_size, trained), rel=1e-6)
    assert per_token < flops_per_token(cfg, n, cfg.block_size) - 1.9 * (n - trained)  # 6 N would say more


@pytest.mark.parametrize(("rate", "shown"), [(7.46, "7.5"), (38.2, "38"), (999.4, "999"), (1234.0, "1.2k")])
def test_tokens_per_second_are_never_shown_as_zero_k(rate: float, shown: str) -> None:
    assert fmt_rate(rate) == shown
