"""GGUF in and out for Gemma 3, Qwen3 and SmolLM3 (llama.cpp's ``gemma3``, ``qwen3``, ``smollm3``).

Files are written from a tiny random Hugging Face model the way llama.cpp's converter writes them
(``gguf_files.hf_to_gguf``: Gemma 3's norm weights with 1 added and its embedding cut to the
tokenizer, SmolLM3's query/key rows in adjacent pairs, the window and head size in metadata);
lmcli reads them to the same model as the Hugging Face folder, past the sliding window, and its
own export writes the same tensors and metadata and reads back. What llama.cpp fixes in code
(Gemma 3's layer pattern and local rotary base, SmolLM3's layers without rotary) is refused on
export in one line when a model differs. llama.cpp's own logits: ``check_gguf.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from families import VARIANTS, hf_folder  # noqa: E402
from gguf_files import field, hf_to_gguf  # noqa: E402
from helpers import assert_one_line_error, run_cli  # noqa: E402

from lmcli.formats.export.gguf import write_gguf  # noqa: E402
from lmcli.formats.gguf.vocab import gguf_vocab, write_vocab  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402

WINDOW = 4
# llama.cpp-shaped variants: what its code fixes, as it fixes it
GGUF_VARIANTS = {
    "gemma3-gguf": (
        transformers.Gemma3TextConfig,
        dict(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=7,  # five local, one global, one local again
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            max_position_embeddings=64,
            sliding_window=WINDOW,
        ),
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "pad_token": "<pad>"},
        3,  # embedding rows past the tokenizer's: llama.cpp's converter cuts them off
    ),
    "qwen3-gguf": (
        transformers.Qwen3Config,
        dict(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        0,
    ),
    "smollm3-gguf": (
        transformers.SmolLM3Config,
        dict(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=5,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=64,
            no_rope_layer_interval=4,
        ),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|im_end|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
        0,
    ),
}
TEXT = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree."


@pytest.fixture(autouse=True)
def _variants(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, variant in GGUF_VARIANTS.items():
        monkeypatch.setitem(VARIANTS, name, variant)


def converted(tmp_path: Path, name: str, kind: str = "F32") -> tuple[Path, Path]:
    """The variant's folder and the GGUF file llama.cpp's converter would make of it."""
    folder = hf_folder(tmp_path, name)
    tok = load_model(folder).tokenizer

    def vocabulary(writer, n: int) -> None:  # (the tokenizer is not what this file tests)
        write_vocab(writer, gguf_vocab(tok, n, gguf.TokenType), tok.chat_template)

    return folder, hf_to_gguf(folder, tmp_path / f"{name}-{kind}.gguf", vocabulary, kind)


def logits(ckpt, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.model(torch.tensor([ids]))[0].double()


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_gguf_import_equals_the_hf_import_of_the_same_weights(tmp_path: Path, name: str) -> None:
    folder, path = converted(tmp_path, name)
    hf, ours = load_model(folder), load_model(path, dtype=torch.float32)
    ids = hf.tokenizer.encode(TEXT)
    assert len(ids) > 3 * WINDOW  # past the window
    a, b = dataclasses.asdict(hf.model_config), dataclasses.asdict(ours.model_config)
    vocab = b["vocab_size"]
    different = {k for k in a if a[k] != b[k]} - {"vocab_size", "norm_eps"}  # (eps: a float32 there)
    assert not different, {k: (a[k], b[k]) for k in different}
    assert b["norm_eps"] == pytest.approx(a["norm_eps"])
    torch.testing.assert_close(logits(ours, ids), logits(hf, ids)[:, :vocab], rtol=1e-5, atol=1e-5)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        reference = theirs(torch.tensor([ids])).logits[0, :, :vocab].double()
    torch.testing.assert_close(logits(ours, ids), reference, rtol=1e-4, atol=1e-4)
    if name == "gemma3-gguf":
        cfg = ours.model_config
        assert (cfg.sliding_window, cfg.layer_pattern, cfg.rope_local_base) == (WINDOW, "LLLLLG", 10000.0)
        assert vocab == hf.tokenizer.vocab_size < hf.model_config.vocab_size  # the rows were cut


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_export_writes_what_llama_cpp_converter_writes_and_reads_back(tmp_path: Path, name: str) -> None:
    folder, converted_path = converted(tmp_path, name)
    src = load_model(folder)
    out = write_gguf(src.model, src.tokenizer, tmp_path / "out.gguf", "f32")
    ours, theirs = gguf.GGUFReader(out), gguf.GGUFReader(converted_path)
    arch = field(theirs, "general.architecture")
    assert field(ours, "general.architecture") == arch
    for key, f in theirs.fields.items():  # every hyperparameter the converter writes, equal
        if key.startswith(f"{arch}.") and key != f"{arch}.context_length":
            assert field(ours, key) == f.contents(), key
    mine = {t.name: t.data for t in ours.tensors}
    for t in theirs.tensors:
        rows = t.data.shape[0]  # (the converter cut Gemma 3's embedding to the tokenizer)
        ours_t, theirs_t = torch.from_numpy(mine[t.name][:rows].copy()), torch.from_numpy(t.data.copy())
        torch.testing.assert_close(ours_t, theirs_t)
    assert set(mine) == {t.name for t in theirs.tensors}
    back = load_model(out, dtype=torch.float32)
    ids = src.tokenizer.encode(TEXT)
    torch.testing.assert_close(logits(back, ids), logits(src, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("gemma3-window-scaled", "a layer pattern other than five local layers then a global one"),
        ("qwen3-window-untied", "GGUF's qwen3 architecture cannot express this model (a layer pattern)"),
        ("smollm3-nope-window", "layers without rotary other than each fourth"),
    ],
)
def test_what_llama_cpp_fixes_otherwise_is_refused_on_export(
    tmp_path: Path, capsys, name: str, message: str
) -> None:
    folder = hf_folder(tmp_path, name)
    capsys.readouterr()
    code, _, err = run_cli(["export", str(folder), str(tmp_path / "x.gguf"), "--format", "gguf"], capsys)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_sample_and_verify_read_the_file_as_the_folder(tmp_path: Path, capsys, name: str) -> None:
    """Greedy tokens from the GGUF file equal those from the folder (past the window)."""
    import json

    folder, path = converted(tmp_path, name)
    capsys.readouterr()
    got = []
    for source in (folder, path):
        command = ["sample", str(source), "-p", "the cat sat", "--max-new-tokens", "12", "--json"]
        code, out, err = run_cli([*command, "--temperature", "0"], capsys)
        assert code == 0, err
        got.append(json.loads(out)["tokens"])
    assert got[0] == got[1]
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 0, err
    assert "note:" not in out


def test_a_gemma3_file_without_its_window_is_read_as_llama_cpp_reads_it_and_verify_says_so(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp reads a ``gemma3`` file without ``attention.sliding_window`` as attending to the
    whole context on every layer (its logits on such a file equal lmcli's); verify names the key."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window", lambda self, value: None)
    _, path = converted(tmp_path, "gemma3-gguf")
    capsys.readouterr()
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 0, err
    assert "\n    note: gemma3.attention.sliding_window is missing: read as llama.cpp reads it" in out
    cfg = load_model(path).model.config
    assert not cfg.sliding_window and not cfg.layer_pattern


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
def test_a_q8_0_file_runs_as_stored_as_it_reads_dequantized(tmp_path: Path, name: str) -> None:
    """The native kernels' path (block matrices kept as stored, the rest mapped as read): each
    product on its dequantized blocks gives the logits of the file read dequantized."""
    from lmcli.formats.gguf.as_stored import load_as_stored
    from lmcli.formats.gguf.load import load_gguf, read_gguf_header
    from lmcli.model.native import ops
    from lmcli.model.native.blocks import dequantize_blocks
    from lmcli.model.quant import BlockLinear

    if not ops.available():
        pytest.skip("native kernels not built here")
    folder, path = converted(tmp_path, name, "Q8_0")
    stored = load_as_stored(read_gguf_header(path), torch.float32)
    plain, tok, _ = load_gguf(path, torch.float32)
    assert any(isinstance(m, BlockLinear) for m in stored.modules())
    ids = torch.tensor([tok.encode(TEXT)])

    def product(self: BlockLinear, x: torch.Tensor) -> torch.Tensor:
        return x @ dequantize_blocks(self.blocks, self.fmt, self.in_features).to(x.dtype).T

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockLinear, "product", product)
        torch.testing.assert_close(stored(ids), plain(ids), rtol=1e-4, atol=1e-4)


def test_a_gemma3_file_steps_every_layer_natively_and_verbose_says_so(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A Gemma 3 file as stored (q8_0 matrices, the tied head's too): its five-of-six windowed
    layers and the global ones all take the one-call step, the head and embedding read from the
    file's blocks; the steps equal the per-operation steps past the window, through the ring."""
    from lmcli.formats.gguf.as_stored import load_as_stored
    from lmcli.formats.gguf.load import read_gguf_header
    from lmcli.generate.decoding import prefill
    from lmcli.model import fastpath
    from lmcli.model.native import ops
    from lmcli.model.quant import BlockEmbedding, BlockLinear

    if not ops.available():
        pytest.skip("native kernels not built here")
    _, path = converted(tmp_path, "gemma3-gguf", "Q8_0")
    model = load_as_stored(read_gguf_header(path), torch.float32)
    assert type(model.lm_head) is BlockLinear and type(model.wte) is BlockEmbedding
    assert model.wte.table is model.lm_head  # the tied embedding looks its rows up in the head's blocks
    ids = torch.randint(
        5, model.config.vocab_size, (1, 5 * WINDOW), generator=torch.Generator().manual_seed(0)
    )
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("LMCLI_NATIVE_LAYER", flag)
        with torch.no_grad(), fastpath.inference(model):
            assert (model.fast_step.head is not None) == (flag == "1")
            cache, first = prefill(model, [ids[0, :3].tolist()], 0, window_slack=0)
            runs.append([first[0]] + [model(ids[:, t : t + 1], cache)[0, -1] for t in range(3, ids.size(1))])
        assert cache.ring is not None and cache.ring.k.size(3) == WINDOW
    native, per_op = torch.stack(runs[0]), torch.stack(runs[1])
    assert (native - per_op).abs().max() <= 0.02 * per_op.abs().max()  # (int8 activations both ways)
    assert torch.equal(native.argmax(-1), per_op.argmax(-1))
    monkeypatch.setenv("LMCLI_NATIVE_LAYER", "1")
    code, _, err = run_cli(
        ["sample", str(path), "-p", "the cat", "--max-new-tokens", "3", "--verbose"], capsys
    )
    assert code == 0, err
    assert "native step: 7 of 7 layers (6 windowed)" in err.splitlines()
