"""A model's skeleton (``lmcli.model.skeleton``): the same tensors as the model, on the meta
device, built without torch's Python meta kernels; loading a file checks it on skeletons without
importing ``torch._dynamo`` (~70 MB resident, a fifth of a small GGUF file's memory budget)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import GEMMA3_BLOCK, tiny_model, tiny_tokenizer

from lmcli.config.train import TrainConfig
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.export.gguf import write_gguf
from lmcli.formats.export.hf import export_hf
from lmcli.model.skeleton import shapes_only, skeleton

LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_embd=64, n_head=4, n_kv_head=2)
VARIANTS = {
    "gpt2": dict(position="learned"),
    "llama": LLAMA,
    "yarn": LLAMA | dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=16),
    "gemma3": LLAMA | dict(rope_local_base=10_000.0, sliding_window=8, layer_pattern="LG"),
    "alibi": dict(position="alibi"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_skeleton_holds_the_models_tensors_on_meta(variant: str) -> None:
    model = tiny_model(vocab_size=300, **VARIANTS[variant])
    bones = skeleton(model.config)
    params = dict(bones.named_parameters())
    assert {k: (v.shape, v.dtype) for k, v in params.items()} == {
        k: (v.shape, v.dtype) for k, v in model.named_parameters()
    }
    assert all(p.is_meta for p in params.values())  # nothing allocated, nothing drawn at random
    tables = {k: (v.shape, v.dtype) for k, v in model.named_buffers()}
    assert {k: (v.shape, v.dtype) for k, v in bones.named_buffers()} == tables
    assert all(t.is_meta for t in bones.buffers())  # position tables by their shapes alone


def test_shapes_only_joins_meta_tensors_by_shape_and_refuses_what_torch_refuses() -> None:
    a, b = torch.empty(3, 5, device="meta"), torch.empty(4, 5, device="meta")
    with shapes_only():
        assert torch.cat([a, b]).shape == (7, 5) and torch.cat([a, b]).is_meta
        assert torch.cat([a, a], dim=-1).shape == (3, 10)
        assert torch.equal(torch.cat([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))
        with pytest.raises(RuntimeError, match="do not join"):
            torch.cat([a, torch.empty(4, 6, device="meta")])
        w = torch.ones(2, 3)
        torch.nn.init.normal_(w)  # an initializer leaves the tensor as it is
        for shifted in (a + 1.0, 1.0 - a, a * 2, torch.add(a, 1), a.half() - 1.0):  # Gemma 3's norms
            assert shifted.is_meta and shifted.shape == a.shape
        assert (a.half() + 1.0).dtype == torch.float16 and (a.long() + 0.5).dtype == torch.float32
        assert torch.equal(torch.ones(2) + 1.0, torch.full((2,), 2.0))  # real tensors: real arithmetic
    assert torch.equal(w, torch.ones(2, 3))
    with pytest.raises(RuntimeError):  # torch itself refuses the same join
        torch.cat([a, torch.empty(4, 6, device="meta")])


LOAD = """
import sys
from lmcli.formats.sources import load_model
ckpt = load_model(sys.argv[1], "cpu", as_stored=sys.argv[1].endswith(".gguf"), quantize=sys.argv[2])
assert ckpt.model.config.n_layer == 2
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""


GEMMA3 = GEMMA3_BLOCK | dict(n_embd=64, n_head=4, n_kv_head=1, head_size=16, sliding_window=8)
GEMMA3 |= dict(layer_pattern="L", rope_local_base=10_000.0, scale_embeddings=True, attn_scalar=16.0)


def test_loading_a_gguf_file_or_a_folder_never_imports_torch_dynamo(tmp_path: Path) -> None:
    tok = tiny_tokenizer(kind="byte")
    model = tiny_model(vocab_size=tok.vocab_size, n_layer=2, **LLAMA)
    save_checkpoint(tmp_path / "run", model, TrainConfig(), tok, meta={"step": 0})
    gemma = tiny_model(vocab_size=tok.vocab_size, n_layer=2, **GEMMA3)  # its norms are stored shifted by 1
    sources = [
        (str(write_gguf(model, tok, tmp_path / "m.gguf", "q8_0")), "none"),
        (str(write_gguf(gemma, tok, tmp_path / "gemma3.gguf", "q8_0")), "none"),
        (str(export_hf(tmp_path / "run", tmp_path / "hf")), "int8"),
        (str(tmp_path / "run"), "none"),
    ]
    for source, quantize in sources:
        done = subprocess.run(
            [sys.executable, "-c", LOAD, source, quantize], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["no", "dynamo"], source
