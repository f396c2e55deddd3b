"""Llama, Qwen2, Mistral and GPT-2 folders in and out, checked by transformers' own code.

Per family and for the GQA, untied, biased and rope-scaled variants: logits, greedy generation,
perplexity and the first training loss equal transformers'; exported runs load in transformers
with the same logits and tokens; export -> import -> export gives identical tensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

from families import VARIANTS, hf_folder  # noqa: E402
from helpers import (  # noqa: E402
    GEMMA3_BLOCK,
    TINY_TEXT,
    assert_float32_close,
    assert_one_line_error,
    make_run,
    run_cli,
    train_config,
)
from safetensors.torch import load_file  # noqa: E402

from lmcli.config.commands import SampleConfig  # noqa: E402
from lmcli.config.model import ModelConfig  # noqa: E402
from lmcli.errors import LmcliError  # noqa: E402
from lmcli.formats.export.hf import export_hf  # noqa: E402
from lmcli.formats.hf.load import load_hf_folder  # noqa: E402
from lmcli.formats.sources import load_checkpoint  # noqa: E402
from lmcli.generate.sampling import generate  # noqa: E402

NAMES = list(VARIANTS)
TEXT = "the cat sat on the mat. a bird sang in the tree.\n" * 6


def hf_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers(tmp_path: Path, name: str) -> None:
    folder = hf_folder(tmp_path, name, shards=2 if name.startswith("llama") else 1)
    ours, tok = load_hf_folder(folder)
    idx = torch.randint(0, tok.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_float32_close(ours(idx), hf_model(folder)(idx).logits, ours.config)  # rounding alone


def test_a_weight_a_thousandth_off_fails_the_parity_check(tmp_path: Path) -> None:
    """The tolerance admits float32 rounding (``helpers.float32_tolerance``), not a wrong number:
    on the variant that differs most from transformers through rounding, one block's MLP output
    projection 0.1% off fails the check that the right weights pass."""
    folder = hf_folder(tmp_path, "qwen2-gqa-bias-yarn")
    ours, tok = load_hf_folder(folder)
    idx = torch.randint(0, tok.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf_model(folder)(idx).logits
        assert_float32_close(ours(idx), theirs, ours.config)
        ours.h[0].mlp.c_proj.weight.mul_(1.001)
        with pytest.raises(AssertionError, match="not close"):
            assert_float32_close(ours(idx), theirs, ours.config)


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_come_from_the_folder(tmp_path: Path, name: str) -> None:
    folder = hf_folder(tmp_path, name)
    _, tok = load_hf_folder(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.eos_id == hf_tok.eos_token_id
    assert tok.bos_id == (
        hf_tok.bos_token_id if hf_tok.bos_token_id is not None else hf_model(folder).config.bos_token_id
    )
    assert tok.pad_id == (hf_tok.pad_token_id if hf_tok.pad_token_id is not None else tok.eos_id)
    assert tok.encode(TEXT) == hf_tok(TEXT, add_special_tokens=False)["input_ids"]
    if name.startswith("qwen2"):  # eos is <|im_end|>, not the <|endoftext|> lmcli's names would pick
        assert tok.token(tok.eos_id) == "<|im_end|>" and tok.chat_template is not None


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuation_equals_hf_generate(tmp_path: Path, name: str) -> None:
    folder = hf_folder(tmp_path, name)
    ours, tok = load_hf_folder(folder)
    prompt = [tok.bos_id, *tok.encode("the cat sat")]
    out = generate(ours, tok, [prompt], SampleConfig(temperature=0, max_new_tokens=32))[0].ids
    with torch.no_grad():
        hf = (
            hf_model(folder)
            .generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # Qwen2's bos is also its pad
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=tok.eos_id,
                pad_token_id=tok.pad_id,
            )[0, len(prompt) :]
            .tolist()
        )
    if tok.eos_id in hf:
        hf = hf[: hf.index(tok.eos_id)]
    assert len(hf) > 8 and out == hf


def hf_perplexity(model: torch.nn.Module, ids: list[int], context: int, stride: int) -> float:
    """The Hugging Face perplexity-guide loop (windows of context + 1 ids, overlap not rescored)."""
    seq = torch.tensor([ids])
    total, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, seq.size(1), stride):
            end = min(begin + context + 1, seq.size(1))
            x = seq[:, begin:end]
            y = x.clone()
            y[:, : -(end - prev_end)] = -100
            logits = model(x).logits[:, :-1]
            total += F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += int((y[:, 1:] != -100).sum())
            prev_end = end
            if end == seq.size(1):
                break
    return math.exp(total / count)


@pytest.mark.parametrize("name", NAMES)
def test_cli_eval_perplexity_equals_the_hf_loop(tmp_path: Path, name: str, capsys) -> None:
    folder = hf_folder(tmp_path, name)
    (tmp_path / "t.txt").write_text(TEXT)
    argv = ["eval", str(folder), str(tmp_path / "t.txt"), "--context", "31", "--stride", "16", "--json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "context capped" not in err  # a sliding window is a mask on its layers, not a shorter context
    ours = json.loads(out.splitlines()[-1])
    _, tok = load_hf_folder(folder)
    ids = transformers.AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"]  # its default: no <bos>
    assert ids == tok.with_bos(tok.encode(TEXT)) and ids[0] != tok.bos_id
    assert ours["tokens"] == len(ids) - 1 > 64
    assert ours["perplexity"] == pytest.approx(hf_perplexity(hf_model(folder), ids, 31, 16), rel=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "llama-gqa-untied-llama3",
        "qwen2-gqa-bias-yarn",
        "mistral-gqa-window",
        "gemma3-window-scaled",
        "qwen3-window-untied",
        "smollm3-nope-window",
    ],
)
def test_first_training_step_of_init_from_has_the_hf_loss(tmp_path: Path, name: str) -> None:
    from lmcli.data.train_data import load_train_data
    from lmcli.train import Reporter, train

    folder = hf_folder(tmp_path, name)
    (tmp_path / "c.txt").write_text(TINY_TEXT)
    cfg = train_config(
        corpus=(str(tmp_path / "c.txt"),),
        init_from=str(folder),
        out=str(tmp_path / "ft"),
        cache_dir=str(tmp_path / "cache"),
        max_steps=1,
        log_interval=1,
        eval_interval=1,
        eval_batches=1,
        batch_size=2,
        warmup_steps=0,
    )
    train(ModelConfig(), cfg, reporter=Reporter(info=lambda m: None), progress=False)
    logged = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["step"] == 1
    _, tok = load_hf_folder(folder)
    block = load_hf_folder(folder)[0].config.block_size
    batch = load_train_data(cfg, block_size=block, tokenizer=tok).sampler(2, cfg.seed).batch(0, 2)
    with torch.no_grad():
        logits = hf_model(folder)(batch.x).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.y.reshape(-1)).item()
    assert logged["train_loss"] == pytest.approx(hf_loss, rel=1e-5, abs=1e-5)
    tuned = load_checkpoint(tmp_path / "ft" / "last")  # the folder's special tokens travel with the run
    assert (tuned.tokenizer.eos_id, tuned.tokenizer.bos_id) == (tok.eos_id, tok.bos_id)
    assert tuned.tokenizer.chat_template == tok.chat_template


# ----------------------------------------------------------------------------- export

EXPORTABLE = {
    "gpt2": ({}, "GPT2LMHeadModel"),
    "llama-tied": (dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False), "LlamaForCausalLM"),
    "llama-gqa-untied-scaled": (
        dict(
            position="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            n_kv_head=1,
            tie_embeddings=False,
            rope_base=500.0,
            rope_scaling="llama3",
            rope_factor=4.0,
            rope_original_context=8,
        ),
        "LlamaForCausalLM",
    ),
    "qwen2-gqa-bias": (
        dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, n_kv_head=1),
        "Qwen2ForCausalLM",
    ),
    "qwen2-yarn-untied": (
        dict(
            position="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            qkv_bias=True,
            tie_embeddings=False,
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_context=8,
        ),
        "Qwen2ForCausalLM",
    ),
    "gemma3-window": (
        dict(
            **GEMMA3_BLOCK,
            scale_embeddings=True,
            head_size=16,
            n_kv_head=2,
            n_layer=3,
            sliding_window=4,
            layer_pattern="LLG",
            rope_local_base=100.0,
            attn_scalar=24.0,
        ),
        "Gemma3ForCausalLM",
    ),
    "qwen3-window": (
        dict(
            position="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            qk_norm=True,
            head_size=16,
            n_kv_head=2,
            sliding_window=4,
            layer_pattern="GL",
            tie_embeddings=False,
        ),
        "Qwen3ForCausalLM",
    ),
    "smollm3-nope": (
        dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_layer=4, rope_pattern="RRRN"),
        "SmolLM3ForCausalLM",
    ),
    "qwen2-window-pattern": (
        dict(
            position="rope",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            qkv_bias=True,
            sliding_window=4,
            layer_pattern="GL",
        ),
        "Qwen2ForCausalLM",
    ),
    "mistral-window": (
        dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, sliding_window=4),
        "MistralForCausalLM",
    ),
}


def randomized_run(tmp: Path, config: dict) -> Path:
    """A run folder of a tiny model whose every weight (biases, norms too) is random."""
    run = make_run(tmp / "run", kind="bpe", **config)
    ckpt = load_checkpoint(run)
    with torch.no_grad():
        for p in ckpt.model.parameters():
            p.normal_(1.0 if p.dim() == 1 and bool((p == 1).all()) else 0.0, 0.3)
    from lmcli.formats.checkpoint import save_checkpoint

    for name in ("last", "best"):
        save_checkpoint(run / name, ckpt.model, ckpt.train_config, ckpt.tokenizer, meta={"step": 0})
    return run


@pytest.mark.parametrize("name", list(EXPORTABLE))
def test_export_loads_in_transformers_with_the_same_logits_and_tokens(tmp_path: Path, name: str) -> None:
    config, arch = EXPORTABLE[name]
    run = randomized_run(tmp_path, config)
    out = export_hf(run, tmp_path / "hf")
    model = hf_model(out)
    assert type(model).__name__ == arch
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ckpt = load_checkpoint(run)
    tok = ckpt.tokenizer
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tok.bos_id,
        tok.eos_id,
        tok.pad_id,
    )
    text = "the dog sat on the log."
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == [tok.bos_id, *ids]  # <bos> first, as lmcli reads a text
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    idx = torch.tensor([[tok.bos_id, *ids] * 2])
    with torch.no_grad():
        assert_float32_close(ckpt.model(idx), model(idx).logits, ckpt.model_config)  # rounding alone


def assert_same_tensors(a: Path, b: Path) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    for key in x:
        assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("name", list(EXPORTABLE))
def test_export_import_export_round_trips_to_identical_tensors(tmp_path: Path, name: str) -> None:
    run = randomized_run(tmp_path, EXPORTABLE[name][0])
    first = export_hf(run, tmp_path / "a")
    second = export_hf(first, tmp_path / "b")
    assert_same_tensors(first, second)
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_bf16_folder_loads_in_the_dtype_asked_for_and_exports_unchanged(tmp_path: Path, dtype) -> None:
    folder = hf_folder(tmp_path, "qwen2-gqa-bias-yarn", dtype=dtype)
    stored = load_file(str(folder / "model.safetensors"))
    kept, _ = load_hf_folder(folder)  # as stored: the tensors are the file's, not copies
    assert {p.dtype for p in kept.parameters()} == {dtype}
    assert torch.equal(kept.wte.weight, stored["model.embed_tokens.weight"])
    wide, _ = load_hf_folder(folder, torch.float32)
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    out = export_hf(folder, tmp_path / "again")
    again = load_file(str(out / "model.safetensors"))
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)


def test_sample_and_beam_read_a_folder_directly(tmp_path: Path, capsys) -> None:
    folder = hf_folder(tmp_path, "llama-gqa-untied-llama3")
    code, out, err = run_cli(
        ["sample", str(folder), "-p", "the cat", "--temperature", "0", "--max-new-tokens", "8", "--json"],
        capsys,
    )
    assert code == 0, err
    assert len(json.loads(out)["tokens"]) >= 1
    code, out, err = run_cli(
        [
            "beam",
            str(folder),
            "-p",
            "the cat",
            "--beam-size",
            "3",
            "--max-new-tokens",
            "8",
            "--dtype",
            "bfloat16",
        ],
        capsys,
    )
    assert code == 0, err
    assert out.startswith("0\t")


# ----------------------------------------------------------------------------- bad input


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "case, message",
    [
        ("architecture", "unsupported architecture 'GPTNeoXForCausalLM'"),
        ("rope", "unsupported rope_scaling type 'dynamic'"),
        ("shard", "is missing shard model-00002-of-0000"),
        ("shape", "has shape (64, 32), config expects (48, 32)"),
        ("eos", "eos token '<|nowhere|>' is not in its vocabulary"),
        ("no-eos", "tokenizer has no end-of-text token"),
    ],
)
def test_bad_folders_give_one_line_naming_the_problem(
    tmp_path: Path, case: str, message: str, capsys
) -> None:
    folder = hf_folder(tmp_path, "llama-tied", shards=2 if case == "shard" else 1)
    config = folder / "config.json"
    if case == "architecture":
        edit_json(config, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    elif case == "rope":
        edit_json(config, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, rope_parameters=None)
    elif case == "shard":
        next(folder.glob("model-00002-of-*.safetensors")).unlink()
    elif case == "shape":
        edit_json(config, intermediate_size=48)
    elif case == "eos":
        edit_json(folder / "tokenizer_config.json", eos_token="<|nowhere|>")
    elif case == "no-eos":  # no eos named anywhere, and none of the usual names in the vocabulary
        edit_json(folder / "tokenizer_config.json", eos_token=None)
        edit_json(config, eos_token_id=None)
        edit_json(folder / "generation_config.json", eos_token_id=None)
        tok = json.loads((folder / "tokenizer.json").read_text())
        for added in tok["added_tokens"]:
            added["content"] = added["content"].replace("</s>", "<end>")
        tok["model"]["vocab"] = {k.replace("</s>", "<end>"): v for k, v in tok["model"]["vocab"].items()}
        (folder / "tokenizer.json").write_text(json.dumps(tok))
    (tmp_path / "t.txt").write_text(TEXT)
    code, _, err = run_cli(["eval", str(folder), str(tmp_path / "t.txt")], capsys)
    assert_one_line_error(code, err, message)


def test_a_model_no_family_expresses_is_refused_naming_what_does_not_fit(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", position="alibi", norm="rmsnorm", mlp="swiglu", bias=False)
    with pytest.raises(LmcliError, match="no Hugging Face family expresses this model \\(alibi positions\\)"):
        export_hf(run, tmp_path / "hf")
    run = make_run(tmp_path / "run2", n_head=2, n_kv_head=1)
    with pytest.raises(LmcliError, match="GPT-2 cannot express this model \\(grouped-query attention\\)"):
        export_hf(run, tmp_path / "hf")
    for i, (options, message) in enumerate(
        [
            (dict(qk_norm=True), "GPT-2 cannot express this model \\(qk-norm\\)"),
            (dict(logit_softcap=30.0), "GPT-2 cannot express this model \\(logit soft-capping\\)"),
            (
                dict(position="rope", norm="rmsnorm", mlp="relu2", bias=False, qk_norm=True),
                "no Hugging Face family expresses this model \\(a relu2 MLP\\)",  # Qwen3 has qk-norm
            ),
        ]
    ):
        with pytest.raises(LmcliError, match=message):
            export_hf(make_run(tmp_path / f"new-{i}", **options), tmp_path / "hf")
    gemma = dict(position="rope", norm="rmsnorm1p", norm_placement="sandwich", mlp="geglu", bias=False)
    with pytest.raises(LmcliError, match="expresses this model \\(no qk-norm, unscaled embeddings\\)"):
        export_hf(
            make_run(tmp_path / "gemma", **gemma, sliding_window=4, layer_pattern="LG"), tmp_path / "hf"
        )
    with pytest.raises(LmcliError, match="expresses this model \\(an attention scale\\)"):
        options = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
        export_hf(make_run(tmp_path / "nope", **options, rope_pattern="RN", attn_scalar=3.0), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("add_bos", [False, True])
def test_bos_follows_add_bos_token_so_perplexity_is_transformers_default(
    tmp_path: Path, add_bos: bool, capsys
) -> None:
    """A Llama folder saying ``add_bos_token`` (and, when true, a tokenizer.json that puts it
    first, which transformers follows): lmcli's eval scores the ids transformers' tokenizer
    gives by default, and its perplexity is transformers' on them; sample's prompt starts so."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    folder = hf_folder(tmp_path, "llama-tied")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": add_bos}))
    if add_bos:
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
        tok.save(str(folder / "tokenizer.json"))
    (tmp_path / "t.txt").write_text(TEXT)
    code, out, err = run_cli(["eval", str(folder), str(tmp_path / "t.txt"), "--json"], capsys)
    assert code == 0, err
    ours = json.loads(out.splitlines()[-1])
    ids = transformers.AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"]
    _, tok = load_hf_folder(folder)
    assert (ids[0] == tok.bos_id) is add_bos and tok.add_bos is add_bos
    assert ours["tokens"] == len(ids) - 1
    context = load_hf_folder(folder)[0].config.block_size
    assert ours["perplexity"] == pytest.approx(
        hf_perplexity(hf_model(folder), ids, context, context), rel=1e-5
    )
