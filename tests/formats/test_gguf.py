"""GGUF export: the file reads back with gguf's own reader, and computes lmcli's logits.

``reference_logits`` (``gguf_files.py``) is a forward pass written from GGUF's side: it reads
nothing but the file (metadata and tensors, through ``gguf.GGUFReader``) and computes what
llama.cpp's ``gpt2`` and ``llama`` graphs compute, with llama.cpp's rotary convention (adjacent
pairs). So these tests catch a wrong tensor name, shape, layout, rotary order or metadata value
without llama.cpp itself; ``test_llama_cpp_agrees`` asks llama.cpp too, where it is installed
(make check-gguf).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from check_gguf import randomize, run_checks  # noqa: E402
from gguf_files import field, gguf_weights, reference_logits  # noqa: E402
from helpers import (  # noqa: E402
    assert_float32_close,
    assert_one_line_error,
    make_run,
    run_cli,
    tiny_model,
    tiny_tokenizer,
    train_config,
)

from lmcli.config.files import field_names  # noqa: E402
from lmcli.config.model import ModelConfig  # noqa: E402
from lmcli.errors import LmcliError  # noqa: E402
from lmcli.formats.checkpoint import save_checkpoint  # noqa: E402
from lmcli.formats.export.gguf import export_gguf, write_gguf  # noqa: E402
from lmcli.formats.sources import load_checkpoint  # noqa: E402

TEXT = "the cat sat on the mat. the dog sat on the log! 12 birds sang, didn't they?\n" * 8
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu")
FAMILIES = {
    "gpt2": dict(),
    "gpt2-untied": dict(tie_embeddings=False),
    "llama": dict(**LLAMA, bias=False, tie_embeddings=False),
    "llama-biased": dict(**LLAMA, bias=True),
}
FAMILIES |= {  # issue 19: the 300-token vocabulary padded to 320 rows; the file holds 300
    "gpt2-padded": dict(vocab_multiple=64),
    "llama-padded": dict(**LLAMA, bias=False, tie_embeddings=False, vocab_multiple=64),
}
if "n_kv_head" in field_names(ModelConfig):  # grouped-query attention, once lmcli has it
    FAMILIES["llama-gqa"] = dict(**LLAMA, bias=False, n_head=4, n_kv_head=2)


def random_run(tmp: Path, kind: str = "bpe", **config) -> Path:
    """A run folder (last/ and best/) of a tiny model with every parameter random, gains and
    biases included."""
    tok = tiny_tokenizer(TEXT, kind, vocab_size=300)
    model = tiny_model(tok.vocab_size, **{"block_size": 32, **config})
    randomize(model)
    for name in ("last", "best"):
        save_checkpoint(tmp / "run" / name, model, train_config(), tok, meta={"step": 0})
    return tmp / "run"


# ----------------------------------------------------------------------------- the tests


def expected_tensors(arch: str, cfg: ModelConfig, n_kv: int) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (ggml order: ne0 first, i.e. a linear layer's in-features first)."""
    C, V, F_, D = cfg.n_embd, cfg.vocab_size, cfg.ffn_dim, cfg.head_dim
    out = {"token_embd.weight": (C, V), "output_norm.weight": (C,)}
    layer = {
        "attn_norm": (C,),
        "ffn_norm": (C,),
        "attn_output": (C, C),
        "ffn_up": (C, F_),
        "ffn_down": (F_, C),
    }
    if arch == "gpt2":
        out |= {"position_embd.weight": (C, cfg.block_size), "output_norm.bias": (C,)}
        layer["attn_qkv"] = (C, C + 2 * n_kv * D)
    else:
        layer |= {"attn_q": (C, C), "attn_k": (C, n_kv * D), "attn_v": (C, n_kv * D), "ffn_gate": (C, F_)}
    for i in range(cfg.n_layer):
        for name, shape in layer.items():
            out[f"blk.{i}.{name}.weight"] = shape
            if cfg.bias and not (arch == "llama" and name.endswith("norm")):
                out[f"blk.{i}.{name}.bias"] = shape[-1:]
    if not cfg.tie_embeddings:
        out["output.weight"] = (C, V)
    return out


def assert_layout(reader: gguf.GGUFReader, arch: str, cfg: ModelConfig, dtype: str) -> None:
    """Architecture, hyperparameters, tensor names, shapes and types of one file."""
    n_kv = getattr(cfg, "n_kv_head", None) or cfg.n_head
    assert field(reader, "general.architecture") == arch
    assert field(reader, "general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7}[dtype]
    for key, value in {
        "context_length": cfg.block_size,
        "embedding_length": cfg.n_embd,
        "block_count": cfg.n_layer,
        "feed_forward_length": cfg.ffn_dim,
        "attention.head_count": cfg.n_head,
        "attention.head_count_kv": n_kv,
    }.items():
        assert field(reader, f"{arch}.{key}") == value, key
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes == expected_tensors(arch, cfg, n_kv)
    T = gguf.GGMLQuantizationType
    for t in reader.tensors:
        if len(t.shape) == 1 or dtype == "f32":
            assert t.tensor_type == T.F32, t.name
        elif dtype == "q8_0" and t.shape[0] % 32 == 0 and t.name != "position_embd.weight":
            assert t.tensor_type == T.Q8_0, t.name
        else:  # f16, a q8_0 file's matrix whose rows are not whole 32-value blocks, or a
            # position table (llama-quantize quantizes none)
            assert t.tensor_type == T.F16, t.name


def assert_rounded(got: torch.Tensor, exact: torch.Tensor, tensor_type: gguf.GGMLQuantizationType) -> None:
    """``got`` is ``exact`` rounded to f16, or to Q8_0: 32-value blocks of int8 times a scale
    max|x| / 127 stored as f16 (off by at most half a step plus 127 times the scale's rounding)."""
    if tensor_type == gguf.GGMLQuantizationType.F16:
        torch.testing.assert_close(got, exact.half().double(), rtol=0, atol=0)
    elif tensor_type == gguf.GGMLQuantizationType.Q8_0:
        blocks = exact.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127  # one quantization step per block
        assert ((got.reshape(-1, 32) - blocks).abs() <= step * (0.5 + 127 * 2**-11) + 1e-12).all()
        assert (got - exact).abs().max() > 0  # really quantized
    else:
        torch.testing.assert_close(got, exact, rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_reads_back_names_shapes_values_and_computes_lmcli_logits(tmp_path: Path, family: str) -> None:
    run = random_run(tmp_path, **FAMILIES[family])
    ckpt = load_checkpoint(run)
    cfg, arch = ckpt.model_config, "gpt2" if family.startswith("gpt2") else "llama"
    ids = [ckpt.tokenizer.bos_id, *ckpt.tokenizer.encode("the dog sat on the mat. 12 birds")]
    with torch.no_grad():
        ours = ckpt.model(torch.tensor([ids]))[0].double()

    paths = {dtype: export_gguf(run, tmp_path / f"{dtype}.gguf", dtype) for dtype in ("f32", "f16", "q8_0")}
    readers = {dtype: gguf.GGUFReader(path) for dtype, path in paths.items()}
    for dtype, reader in readers.items():
        assert_layout(reader, arch, cfg, dtype)
    # f32: the model itself, computed from the file alone
    assert_float32_close(reference_logits(paths["f32"], ids), ours, cfg)  # an independent fp32 computation
    # f16, q8_0: the f32 values, rounded as their type says
    exact = gguf_weights(readers["f32"])
    for dtype in ("f16", "q8_0"):
        got = gguf_weights(readers[dtype])
        for t in readers[dtype].tensors:
            assert_rounded(got[t.name], exact[t.name], t.tensor_type)
        err = (reference_logits(paths[dtype], ids) - ours).abs().max().item()
        bound = {"f16": 0.1, "q8_0": 0.25}[dtype]  # q8_0 of tiny random weights: 0.12 seen on GQA
        assert err < bound * ours.abs().max().item(), f"{dtype}: logits off by {err:.2e}"


def test_f32_values_are_the_checkpoint_weights(tmp_path: Path) -> None:
    """Values read back equal lmcli's weights; the llama family's q/k rows in adjacent-pair order."""
    run = random_run(tmp_path, **FAMILIES["llama"])
    path = export_gguf(run, tmp_path / "m.gguf", "f32")
    w = gguf_weights(gguf.GGUFReader(path))
    model = load_checkpoint(run).model
    c_attn = model.h[1].attn.c_attn.weight.double()
    H, D = model.config.n_head, model.config.head_dim
    q = c_attn[: H * D].view(H, D, -1)
    # GGUF's row 2i of a head is lmcli's row i, row 2i+1 is lmcli's row i + D/2
    torch.testing.assert_close(w["blk.1.attn_q.weight"].view(H, D, -1)[:, 0::2], q[:, : D // 2])
    torch.testing.assert_close(w["blk.1.attn_q.weight"].view(H, D, -1)[:, 1::2], q[:, D // 2 :])
    torch.testing.assert_close(w["blk.1.attn_v.weight"], c_attn[2 * H * D :])
    torch.testing.assert_close(w["blk.0.ffn_gate.weight"], model.h[0].mlp.c_gate.weight.double())
    torch.testing.assert_close(w["output.weight"], model.lm_head.weight.double())


def test_tokenizer_metadata_is_lmcli_bpe(tmp_path: Path) -> None:
    """Tokens, types, merges and special ids; ids past the tokenizer's (a padded embedding, as
    imported models have) become unused tokens."""
    tok = tiny_tokenizer(TEXT, "bpe", vocab_size=300)
    model = tiny_model(tok.vocab_size + 3)
    reader = gguf.GGUFReader(write_gguf(model, tok, tmp_path / "m.gguf", "f16"))
    vocab = {i: t for t, i in tok.hf.get_vocab(with_added_tokens=True).items()}
    n = tok.vocab_size
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens[:n] == [vocab[i] for i in range(n)]
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, n + 3)]  # the model's 3 extra ids
    TT = gguf.TokenType
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[:5] == [TT.CONTROL] * 5 and set(types[5:n]) == {TT.NORMAL} and types[n:] == [TT.UNUSED] * 3
    merges = json.loads(tok.to_json())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [
        " ".join(m) if isinstance(m, list) else m for m in merges
    ]
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    for key, value in {
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "padding_token_id": tok.pad_id,
        "unknown_token_id": tok.unk_id,
        "seperator_token_id": tok.sep_id,  # sic: gguf's spelling
        "add_bos_token": True,
        "add_eos_token": False,
    }.items():
        assert field(reader, f"tokenizer.ggml.{key}") == value, key


def test_byte_tokenizer_is_gpt2_bpe_with_one_inert_merge(tmp_path: Path) -> None:
    run = random_run(tmp_path, "byte")
    reader = gguf.GGUFReader(export_gguf(run, tmp_path / "m.gguf", "f32"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 261 and tokens[:5] == ["<pad>", "<unk>", "<bos>", "<eos>", "<sep>"]
    assert field(reader, "tokenizer.ggml.merges") == ["<pad> <unk>"]  # joins no byte-level pieces


@pytest.mark.parametrize(
    ("config", "kind", "message"),
    [
        (dict(), "char", "GGUF cannot express lmcli's char tokenizer"),
        (dict(mlp="relu"), "bpe", "gpt2 architecture cannot express this model (a relu MLP)"),
        (dict(position="alibi"), "bpe", "(alibi positions)"),
        (dict(bias=False), "bpe", "(no biases)"),
        (
            dict(position="rope"),
            "bpe",
            "llama architecture cannot express this model (layernorm, a gelu MLP)",
        ),
        (dict(**LLAMA, norm_placement="post"), "bpe", "(post-norm)"),
        (dict(**LLAMA, qk_norm=True, attn_softcap=50.0), "bpe", "qwen3 architecture cannot express"),
        (dict(logit_softcap=30.0), "bpe", "gpt2 architecture cannot express this model (logit soft-capping)"),
        ({**LLAMA, "mlp": "relu2"}, "bpe", "(a relu2 MLP)"),
    ],
)
def test_what_gguf_cannot_express_is_refused_in_one_line(
    tmp_path: Path, capsys, monkeypatch, config: dict, kind: str, message: str
) -> None:
    run = make_run(tmp_path / "run", kind=kind, **config)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["export", str(run), "--format", "gguf"], capsys)
    assert_one_line_error(code, err, message)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*lmtmp"))


def test_cli_writes_the_default_name_and_never_overwrites(tmp_path: Path, capsys, monkeypatch) -> None:
    run = random_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["export", str(run), "--format", "gguf", "--dtype", "q8_0"], capsys)
    assert code == 0 and out.strip() == "wrote run-q8_0.gguf"
    before = (tmp_path / "run-q8_0.gguf").read_bytes()
    code, _, err = run_cli(["export", str(run), "--format", "gguf", "--dtype", "q8_0"], capsys)
    assert_one_line_error(code, err, "run-q8_0.gguf already exists")
    assert (tmp_path / "run-q8_0.gguf").read_bytes() == before
    code, _, _ = run_cli(["export", str(run / "best"), "--format", "gguf", "-o", "sub/x.gguf"], capsys)
    assert (
        code == 0
        and gguf.GGUFReader(tmp_path / "sub" / "x.gguf").fields["general.name"].contents() == "run-best"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "f16"], "--dtype applies to --format gguf only"),
        (["--format", "gguf", "--dtype", "q4_k"], "invalid dtype 'q4_k': choose one of f32, f16, q8_0, q4_0"),
        (["a.gguf", "--out", "b.gguf", "--format", "gguf"], "give the output once"),
    ],
)
def test_bad_export_options_are_one_line_errors(
    tmp_path: Path, capsys, argv: list[str], message: str
) -> None:
    run = random_run(tmp_path)
    code, _, err = run_cli(["export", str(run), *argv], capsys)
    assert_one_line_error(code, err, message)


def test_export_gguf_refuses_a_char_run_from_the_library(tmp_path: Path) -> None:
    with pytest.raises(LmcliError, match="char tokenizer"):
        export_gguf(make_run(tmp_path / "run"), tmp_path / "x.gguf")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed")
def test_llama_cpp_agrees(tmp_path: Path) -> None:
    """llama.cpp's tokenizer, logits (1e-3) and greedy continuation equal lmcli's (check_gguf.py)."""
    results = run_checks(tmp_path)
    assert all(r.ok for r in results), "\n".join(line for r in results for line in r.lines)
