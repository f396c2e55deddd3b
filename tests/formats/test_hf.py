"""Hugging Face interop: GPT-2 logits and perplexity parity, export loads in transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from helpers import (  # noqa: E402
    assert_float32_close,
    make_run,
    tiny_tokenizer,
    train_config,
)

from lmcli.errors import LmcliError  # noqa: E402
from lmcli.eval.perplexity import score_ids  # noqa: E402
from lmcli.formats.export.hf import export_hf  # noqa: E402
from lmcli.formats.hf.load import load_hf_folder  # noqa: E402
from lmcli.formats.sources import load_checkpoint, load_model  # noqa: E402


def hf_gpt2(tmp: Path) -> Path:
    """A tiny random GPT-2 saved as a local Hugging Face folder, with a byte-level BPE tokenizer."""
    tok = tiny_tokenizer("the cat sat on the mat " * 50, "bpe", vocab_size=300)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=tok.vocab_size,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp / "gpt2")
    tok.save(tmp / "gpt2" / "tokenizer.json")
    return tmp / "gpt2"


def test_imported_gpt2_gives_the_same_logits(tmp_path: Path) -> None:
    folder = hf_gpt2(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ours, _ = load_hf_folder(folder)
    idx = torch.randint(0, hf.config.vocab_size, (2, 30))
    with torch.no_grad():
        assert_float32_close(ours.eval()(idx), hf(idx).logits, ours.config)  # rounding alone


@pytest.mark.parametrize("stride", [31, 8])
def test_perplexity_equals_hugging_face(tmp_path: Path, stride: int) -> None:
    """The HF perplexity-guide loop (max_length = context + 1) on the same ids."""
    folder = hf_gpt2(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ckpt = load_model(folder)
    ids = [
        ckpt.tokenizer.bos_id,
        *ckpt.tokenizer.encode("the cat sat on the mat, the mat sat on the cat. " * 6),
    ]
    context = 31
    count, nll = score_ids(ckpt.model, ids, context, stride)
    seq = torch.tensor([ids])
    total, n_scored, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, seq.size(1), stride):
            end = min(begin + context + 1, seq.size(1))
            trg_len = end - prev_end
            x = seq[:, begin:end]
            y = x.clone()
            y[:, :-trg_len] = -100
            logits = hf(x).logits[:, :-1]
            total += F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1), reduction="sum"
            ).item()
            n_scored += int((y[:, 1:] != -100).sum())
            prev_end = end
            if end == seq.size(1):
                break
    assert count == n_scored
    assert nll / count == pytest.approx(total / n_scored, rel=1e-5)


def test_exported_run_loads_in_transformers_with_the_same_logits_and_tokens(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", kind="bpe")
    out = export_hf(run, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ckpt = load_checkpoint(run)
    text = "the dog sat on the log."
    ids = ckpt.tokenizer.encode(text)
    assert hf_tok(text)["input_ids"] == [ckpt.tokenizer.bos_id, *ids]  # <bos> first, as lmcli reads it
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    with torch.no_grad():
        ours, theirs = ckpt.model(torch.tensor([ids])), model(torch.tensor([ids])).logits
    assert_float32_close(ours, theirs, ckpt.model_config)  # two implementations: rounding alone


@pytest.mark.parametrize(
    "family",
    [dict(), dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)],
    ids=["gpt2", "llama-untied"],
)
def test_a_padded_run_exports_its_logical_vocabulary_with_the_same_logits(
    tmp_path: Path, family: dict
) -> None:
    """A run whose vocabulary is padded to a multiple of 64 exports ``vocab_size`` rows: the
    folder's config, embedding and head say so, and transformers computes lmcli's logits."""
    run = make_run(tmp_path / "run", kind="bpe", vocab_multiple=64, **family)
    ckpt = load_checkpoint(run)
    V = ckpt.model_config.vocab_size
    assert ckpt.model.wte.weight.size(0) == ckpt.model_config.padded_vocab_size > V
    model = transformers.AutoModelForCausalLM.from_pretrained(export_hf(run, tmp_path / "hf")).eval()
    assert model.config.vocab_size == V
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == V
    ids = ckpt.tokenizer.encode("the dog sat on the log.")
    with torch.no_grad():
        ours, theirs = ckpt.model(torch.tensor([ids])), model(torch.tensor([ids])).logits
    assert ours.shape == theirs.shape == (1, len(ids), V)
    assert_float32_close(ours, theirs, ckpt.model_config)  # two implementations: rounding alone


def test_configs_gpt2_cannot_express_are_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", norm="rmsnorm", mlp="swiglu")
    with pytest.raises(LmcliError, match="GPT-2 cannot express this model .*rmsnorm, a swiglu MLP"):
        export_hf(run, tmp_path / "hf")
    run = make_run(tmp_path / "run2", position="rope", norm="rmsnorm")  # Llama's, but a GELU MLP
    with pytest.raises(LmcliError, match="no Hugging Face family expresses this model .a gelu MLP, biases"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_train_init_from_a_local_gpt2_folder(tmp_path: Path) -> None:
    from lmcli.config.model import ModelConfig
    from lmcli.train import Reporter, train

    folder = hf_gpt2(tmp_path)
    (tmp_path / "c.txt").write_text("the cat sat on the mat. " * 200)
    cfg = train_config(
        corpus=(str(tmp_path / "c.txt"),),
        init_from=str(folder),
        out=str(tmp_path / "ft"),
        max_steps=3,
        eval_interval=3,
        batch_size=2,
        lr=1e-6,
        warmup_steps=0,
        eval_batches=1,
    )
    train(ModelConfig(), cfg, reporter=Reporter(info=lambda m: None), progress=False)
    tuned = load_checkpoint(tmp_path / "ft" / "last")
    base, _ = load_hf_folder(folder)
    assert tuned.model_config.n_embd == 32 and tuned.model_config.block_size == 32
    delta = (tuned.model.wte.weight - base.wte.weight).abs().max().item()
    assert 0 < delta < 1e-4  # started from the GPT-2 weights and moved a little
