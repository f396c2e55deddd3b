"""GGUF files run as stored: their block matrices multiplied by the native kernels, compared with
a float64 forward of the same file (``gguf_files.reference_logits``, gguf's own dequantization)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # gguf_files and its helpers
from gguf_files import reference_logits, write_gguf_model  # noqa: E402

from lmcli.formats.gguf.as_stored import load_as_stored, load_gguf_as_stored  # noqa: E402
from lmcli.formats.gguf.load import DEQUANTIZED, read_gguf_header  # noqa: E402
from lmcli.model import quant  # noqa: E402
from lmcli.model.native import ops  # noqa: E402
from lmcli.model.native.blocks import dequantize_blocks, quantize_blocks  # noqa: E402
from lmcli.model.quant import BlockEmbedding, BlockLinear, StackedBlockLinear  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.available(), reason="native kernels not built here")
TEXT = "the cat sat on the mat. 12 birds sang, didn't they?\n"
READ = "are read as their dequantized values (no kernel runs them as stored)"


@pytest.mark.parametrize(
    "arch,kind,tied",
    [
        ("llama", "Q4_K", False),
        ("qwen2", "Q6_K", True),
        ("llama", "Q8_0", True),
        ("qwen2", "Q4_0", False),
        ("qwen2", "Q5_K", False),
        ("qwen2", "Q5_0", False),  # Q4_K_M files of 896-wide models hold some matrices in Q5_0
        ("llama", "Q4_1", True),
        ("qwen2", "Q5_1", True),
        ("llama", "Q2_K", False),  # the presets Q2_K, Q3_K_M, IQ4_XS, IQ4_NL hold these
        ("qwen2", "Q3_K", True),
        ("llama", "IQ4_NL", True),
        ("qwen2", "IQ4_XS", False),
        ("llama", "MXFP4", False),  # recent open-weight releases' format
    ],
)
def test_logits_of_a_file_run_as_stored(tmp_path: Path, arch: str, kind: str, tied: bool) -> None:
    path = write_gguf_model(tmp_path / "m.gguf", arch, kind, tied=tied)
    header = read_gguf_header(path)
    model = load_as_stored(header, torch.float32)
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert isinstance(model.wte, BlockEmbedding) and isinstance(model.lm_head, BlockLinear)
    assert (model.lm_head is model.wte.table) == tied
    # every matrix as stored: the blocks held are the file's bytes, most of them views of the file
    held = sum(m.blocks.numel() for m in linears)
    stored = sum(t.data.nbytes for t in header.tensors.values() if t.kind == kind)
    assert held == stored
    file = header.tensors["blk.0.ffn_up.weight"].data.ctypes.data
    assert model.h[0].mlp.c_fc.blocks.data_ptr() == file  # a view of the memory-mapped file
    ids = torch.tensor([header.tokenizer.with_bos(header.tokenizer.encode(TEXT))])
    ref = reference_logits(path, ids[0].tolist())  # float64 of the dequantized file, from GGUF's side
    assert ref.abs().max() > 3  # logits that tell a wrong layout from a right one
    seen = []  # every product of the forward: (layer, input, output)
    product = BlockLinear.product
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            BlockLinear, "product", lambda self, x: seen.append((self, x, product(self, x))) or seen[-1][2]
        )
        mp.setattr(quant, "BLOCK_GEMM_ROWS", ids.numel() + 1)  # the kernels' integer rows, not the GEMM
        model(ids)
    assert len(seen) == len(linears) - (not tied)  # an untied table is only looked up
    for layer, x, y in seen:  # each product: the dequantized weight times the rounded activations
        ref_y = reference_product(layer, x, rounded=True)
        torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4 * ref_y.abs().max().item())
        # a longer prompt's product: the weight in bfloat16 (the kernels dequantize it), one GEMM
        ref_x = reference_product(layer, x, rounded=False)
        got = layer._bound.gemm(x.reshape(-1, x.size(-1)), 1).to(ref_x.dtype).reshape(ref_x.shape)
        torch.testing.assert_close(got, ref_x, rtol=0.02, atol=0.02 * ref_x.abs().max().item())
    # the layers as loaded, each product on its dequantized blocks: the file's model exactly
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockLinear, "product", lambda self, x: reference_product(self, x, rounded=False))
        torch.testing.assert_close(model(ids)[0].double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def reference_product(self: BlockLinear, x: torch.Tensor, rounded: bool) -> torch.Tensor:
    """``BlockLinear.product`` in float64: x (``rounded``: to int8 per block as the kernels do)
    times the dequantized weight."""
    block = ops.FORMATS[self.fmt].block
    xb = x.float().reshape(-1, x.size(-1) // block, block)  # (..., K) -> (M, K/b, b)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    xq = torch.round(xb * inv).clamp(-127, 127) * d if rounded else xb
    xq = xq.reshape(x.shape).double()
    w = dequantize_blocks(self.blocks, self.fmt, self.in_features).double()
    return (xq @ w.T).to(x.dtype)  # (M, out), without the bias (as product is)


@pytest.mark.parametrize("kind", DEQUANTIZED)
def test_a_file_of_a_rarer_type_loads_dequantized_with_one_note(tmp_path: Path, capsys, kind: str) -> None:
    """IQ1-IQ3, TQ and NVFP4 matrices are read as gguf's dequantized values (never refused), one
    note saying so; the model's logits are the file's (the float64 reference of gguf's values)."""
    path = write_gguf_model(tmp_path / "m.gguf", "llama", kind)
    model, tok, meta = load_gguf_as_stored(path)
    note = f"note: {path}: its {kind} tensors (16) {READ}"
    assert capsys.readouterr().err.splitlines() == [note]
    assert kind in meta["types"] and not any(isinstance(m, BlockLinear) for m in model.modules())
    ids = tok.with_bos(tok.encode(TEXT))
    ref = reference_logits(path, ids)
    with torch.no_grad():
        got = model(torch.tensor([ids]))[0].double()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_a_mixed_file_runs_its_blocks_and_dequantizes_a_rarer_type(tmp_path: Path, capsys) -> None:
    """A Q4_K file with one IQ2_XXS matrix (as IQ2 presets keep some tensors in a K type): the
    K blocks run as stored, the IQ2_XXS one is read as values; `sample` runs with one note."""
    from helpers import run_cli

    path = write_gguf_model(tmp_path / "m.gguf", "llama", "Q4_K", kinds={"blk.1.ffn_down.weight": "IQ2_XXS"})
    model, _, _ = load_gguf_as_stored(path)
    capsys.readouterr()
    assert isinstance(model.h[0].mlp.c_proj, BlockLinear) and not isinstance(
        model.h[1].mlp.c_proj, BlockLinear
    )
    argv = ["sample", str(path), "-p", "the cat", "--temperature", "0", "--max-new-tokens", "3"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {path}: its IQ2_XXS tensors (1) {READ}"]


def test_stacked_parts_of_two_formats() -> None:
    k = 256
    a = BlockLinear(quantize_blocks(torch.randn(8, k), "q8_0"), "q8_0", k)
    b = BlockLinear(quantize_blocks(torch.randn(4, k), "q4_0"), "q4_0", k)
    bias = torch.randn(12)
    layer = StackedBlockLinear([a, b], bias)
    x = torch.randn(2, 3, k)
    torch.testing.assert_close(layer(x), torch.cat([a(x), b(x)], -1) + bias)
    torch.testing.assert_close(layer.dequantized(), torch.cat([a.dequantized(), b.dequantized()]))


def test_commands_run_a_gguf_file_as_stored(tmp_path: Path, capsys) -> None:
    from helpers import run_cli

    from lmcli.cli.common import load_source

    path = write_gguf_model(tmp_path / "m.gguf", "llama", "Q4_K", tied=False)
    ckpt = load_source(path, {})
    assert isinstance(ckpt.model.h[0].mlp.c_fc, BlockLinear)
    assert ckpt.meta["products"].startswith("quantized products: native kernels")
    int8 = load_source(path, {"quantize": "int8"})  # --quantize: the file dequantized, then lmcli's own
    assert not isinstance(int8.model.h[0].mlp.c_fc, StackedBlockLinear)
    (tmp_path / "t.txt").write_text(TEXT * 4)
    for argv in (
        ["sample", str(path), "-p", "the cat", "--temperature", "0", "--max-new-tokens", "5", "--json"],
        ["eval", str(path), str(tmp_path / "t.txt"), "--json", "--context", "32"],
    ):
        code, out, err = run_cli(argv, capsys)
        assert code == 0, err
    code, _, err = run_cli(["sample", str(path), "-p", "the", "--max-new-tokens", "2", "--verbose"], capsys)
    assert code == 0, err
    assert [line for line in err.splitlines() if "products" in line] == [f"{ops.backend_line()}; blocks q4_K"]


@pytest.mark.parametrize("keep", [0.97, 0.5])
def test_a_truncated_k_quant_file_is_one_line_before_any_kernel(tmp_path: Path, capsys, keep: float) -> None:
    from helpers import assert_one_line_error, run_cli

    data = write_gguf_model(tmp_path / "whole.gguf", "qwen2", "Q6_K").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])  # the last tensors' blocks cut short
    code, _, err = run_cli(["sample", str(cut), "-p", "the", "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, "truncated or damaged")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantize_and_gguf_export_write_the_same_blocks(tmp_path: Path, fmt: str) -> None:
    """``--quantize int8|int4`` holds the very bytes ``export --format gguf`` writes (q8_0/q4_0):
    a model quantized in lmcli and its exported file run the same blocks, no round trip."""
    from helpers import tiny_model, tiny_tokenizer

    from lmcli.formats.export.gguf import write_gguf
    from lmcli.model.quant import quantize

    tok = tiny_tokenizer(kind="bpe", vocab_size=300)  # GGUF writes byte-level BPE vocabularies
    cfg = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_head=4, n_kv_head=2, n_embd=64, d_ff=128
    )
    model = tiny_model(tok.vocab_size, **cfg)
    path = write_gguf(model, tok, tmp_path / "m.gguf", fmt)
    stored = load_as_stored(read_gguf_header(path), torch.float32)
    quantize(model, "int8" if fmt == "q8_0" else "int4")
    for name in ("mlp.c_fc", "mlp.c_gate", "mlp.c_proj", "attn.c_proj"):
        ours, theirs = model.h[1].get_submodule(name), stored.h[1].get_submodule(name)
        assert ours.fmt == theirs.fmt == fmt and torch.equal(ours.blocks, theirs.blocks), name
