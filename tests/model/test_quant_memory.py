"""Memory of quantized weights: what quantizing allocates at once, whatever a layer's shape; a
Hugging Face folder quantized as it is read (one block's float weights at a time), the same
layers as quantizing the loaded model; what a GGUF file run as stored allocates (its tied
vocabulary table stays blocks: rows are looked up, the head multiplied as stored).

Sizes are read from torch's profiler (``largest_allocation``: every CPU allocation torch makes,
by operation), not from the process's RSS, so the checks hold on a shared, busy machine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

import lmcli.model.quant as quant
from lmcli.config.commands import SampleConfig
from lmcli.config.train import TrainConfig
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.export.gguf import write_gguf
from lmcli.formats.export.hf import export_hf
from lmcli.formats.sources import load_model
from lmcli.generate.sampling import generate
from lmcli.model import fastpath
from lmcli.model.native import blocks, ops
from lmcli.model.native.blocks import quantize_blocks


def largest_allocation(fn: Callable[[], object]) -> int:
    """The most bytes one torch operation allocated while ``fn()`` ran."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


WIDE = (16, 8192)  # a wide layer (an MLP's down projection), 16 rows of 8192 values


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantize_blocks_of_a_wide_layer_holds_a_chunk_of_float_temporaries(monkeypatch, fmt: str) -> None:
    w = torch.randn(WIDE, generator=torch.Generator().manual_seed(0))
    whole = quantize_blocks(w, fmt)  # one chunk
    monkeypatch.setattr(blocks, "CHUNK_VALUES", WIDE[1])  # a row a chunk
    assert torch.equal(quantize_blocks(w, fmt), whole)  # chunked: the same bytes
    # no float32 temporary of the whole weight (the blocks written are 34/128 or 18/128 of it)
    assert largest_allocation(lambda: quantize_blocks(w, fmt)) < w.numel() * 4 // 2


def test_quantize_int8_of_a_wide_layer_holds_a_chunk_and_leaves_the_weight(monkeypatch) -> None:
    w = torch.randn(WIDE, generator=torch.Generator().manual_seed(0))
    before = w.clone()
    q, s = quant.quantize_int8(w)  # one chunk
    assert torch.equal(w, before)  # the float weight is read, never rounded in place
    monkeypatch.setattr(quant, "CHUNK_VALUES", WIDE[1])  # a row a chunk
    q2, s2 = quant.quantize_int8(w)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    torch.testing.assert_close(q.float() * s[:, None], w, rtol=0, atol=s.max().item() / 2 + 1e-7)
    assert largest_allocation(lambda: quant.quantize_int8(w)) < w.numel() * 4 // 2


@pytest.mark.skipif(not ops.available(), reason="native kernels not built here")
def test_a_gguf_file_run_as_stored_never_holds_its_tied_table_in_floats(tmp_path: Path) -> None:
    """A file whose tied vocabulary table (4096 x 64) is most of its bytes: loading it as stored
    and generating (a prompt past ``BLOCK_GEMM_ROWS``, whose layers take the GEMM path) never
    makes a float copy of the table, not even a bfloat16 one."""
    tok = tiny_tokenizer(kind="byte")
    model = tiny_model(
        vocab_size=4096, n_embd=64, block_size=160, position="rope", norm="rmsnorm", mlp="swiglu", bias=False
    )
    assert model.config.tie_embeddings
    path = write_gguf(model, tok, tmp_path / "m.gguf", "q8_0")
    table = model.config.padded_vocab_size * model.config.n_embd
    prompt = [(7 * i) % tok.vocab_size for i in range(quant.BLOCK_GEMM_ROWS + 4)]
    greedy = SampleConfig(temperature=0, max_new_tokens=8, min_new_tokens=8)
    held = {}

    def run() -> None:
        ckpt = load_model(path, "cpu", as_stored=True)
        held["model"] = ckpt.model
        with torch.inference_mode(), fastpath.inference(ckpt.model):
            held["out"] = generate(ckpt.model, ckpt.tokenizer, [prompt], greedy)[0]

    largest = largest_allocation(run)
    loaded = held["model"]
    assert isinstance(loaded.wte, quant.BlockEmbedding) and loaded.lm_head is loaded.wte.table
    assert len(held["out"].ids) == 8
    assert quant.weight_bytes(loaded) < 1.05 * path.stat().st_size  # the file's bytes, once (and norms)
    assert largest < 2 * table  # no float32 nor bfloat16 table


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_hugging_face_folder_quantized_as_it_is_read(tmp_path: Path, monkeypatch, mode: str) -> None:
    """``load_model(folder, quantize=...)``: each block's float weights become quantized layers
    before the next block is read, and the layers are those of quantizing the loaded model."""
    tok = tiny_tokenizer(kind="byte")
    llama = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_embd=64, n_head=4, n_kv_head=2)
    model = tiny_model(vocab_size=tok.vocab_size, n_layer=3, **llama)
    save_checkpoint(tmp_path / "run", model, TrainConfig(), tok, meta={"step": 0})
    folder = export_hf(tmp_path / "run", tmp_path / "hf")
    reference = quant.quantize(load_model(folder).model, mode, 32)
    seen: dict = {"floats": []}  # float blocks held each time a block is quantized
    vocabulary, block = quant.quantize_vocabulary, quant.quantize_block

    def capture(m: torch.nn.Module, native: bool) -> None:  # the model being read (its head first)
        seen["model"] = m
        vocabulary(m, native)

    def count(b: torch.nn.Module, *args) -> None:
        floats = [
            h
            for h in seen["model"].h
            if type(h.mlp.c_fc) is torch.nn.Linear and not h.mlp.c_fc.weight.is_meta
        ]
        seen["floats"].append(len(floats))
        block(b, *args)

    monkeypatch.setattr(quant, "quantize_vocabulary", capture)
    monkeypatch.setattr(quant, "quantize_block", count)
    read = load_model(folder, quantize=mode, group_size=32).model
    assert seen["floats"] == [1, 1, 1]  # one block in floats at a time, never the float model
    ours, theirs = dict(read.named_buffers()), dict(reference.named_buffers())
    ours.update(read.named_parameters())
    theirs.update(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        torch.testing.assert_close(read(ids), reference(ids), rtol=0, atol=0)
