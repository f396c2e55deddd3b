"""Memory of quantized weights: what quantizing allocates at once, whatever a layer's shape, and
what a GGUF file run as stored allocates (its tied vocabulary table stays blocks: rows are
looked up, the head multiplied as stored).

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
from lmcli.formats.export.gguf import write_gguf
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
