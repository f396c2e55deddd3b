"""Every registered family adapter, on a tiny folder of its family: the name maps and the config
read both ways and give back what they were given.

Each family needs a folder builder in ``families.py`` (a variant whose transformers config has the
family's ``model_type``): adding a family without one fails here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from families import VARIANTS, hf_folder  # noqa: E402

from lmcli.config.model import ModelConfig  # noqa: E402
from lmcli.errors import LmcliError  # noqa: E402
from lmcli.formats.families import FAMILIES, FamilyAdapter, HFConfig, from_gguf_arch, from_hf_config  # noqa: E402
from lmcli.formats.hf.weights import read_weights  # noqa: E402
from lmcli.formats.weights import expected_weights  # noqa: E402

FOLDERS = {name: VARIANTS[name][0].model_type for name in VARIANTS}  # folder builder -> family


def family_folder(tmp: Path, name: str) -> tuple[FamilyAdapter, ModelConfig, dict[str, torch.Tensor]]:
    """The adapter a built folder's config.json names, the config it reads, the folder's tensors."""
    folder = hf_folder(tmp, name)
    hf = HFConfig(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
    family = from_hf_config(hf)
    cfg, _ = family.config_from_hf(hf)
    return family, cfg, read_weights(folder)


def assert_same(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], shifted: tuple[str, ...] = ()
) -> None:
    """Equal tensors; those named in ``shifted`` (stored as 1 + w in float32) to float32's rounding."""
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith(shifted) and shifted:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
        else:
            assert a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_has_a_folder_builder(family: str) -> None:
    assert family in FOLDERS.values(), f"tests/formats/families.py builds no {family} folder"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hf_names_to_lmcli_and_back(tmp_path: Path, name: str) -> None:
    family, cfg, theirs = family_folder(tmp_path, name)
    assert family.name == FOLDERS[name]
    ours = family.from_hf(theirs, cfg)
    assert set(ours) == set(expected_weights(cfg)[0])  # every tensor the model has, nothing else
    assert_same(family.to_hf(ours, cfg), theirs)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_lmcli_names_to_gguf_and_back(tmp_path: Path, name: str) -> None:
    family, cfg, theirs = family_folder(tmp_path, name)
    ours = family.from_hf(theirs, cfg)
    written = family.to_gguf(ours, cfg)
    norms = ("norm.weight", "ln_1.weight", "ln_2.weight", "post.0.weight", "post.1.weight", "ln_f.weight")
    assert_same(family.from_gguf(written, cfg), ours, norms if family.gguf_arch == "gemma3" else ())
    # llama.cpp knows every name for the architecture, and reads it back with the same map
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[family.gguf_arch]
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch] for i in range(cfg.n_layer)}
    assert {k.rsplit(".", 1)[0] for k in written} <= known
    if family.reads_gguf:  # (a family whose GGUF files are not read is refused by name)
        assert from_gguf_arch(family.gguf_arch, "test").gguf_names == family.gguf_names
    else:
        with pytest.raises(LmcliError, match=f"unsupported GGUF architecture '{family.gguf_arch}'"):
            from_gguf_arch(family.gguf_arch, "test")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_to_hf_and_back(tmp_path: Path, name: str) -> None:
    family, cfg, _ = family_folder(tmp_path, name)
    assert family.problems(cfg, "hf") == []
    ids = {"bos": 1, "eos": 2, "pad": 0}
    written = family.hf_config(cfg, ids, "float32")
    again, notices = family.config_from_hf(HFConfig(written, "config.json"))
    assert notices == []
    assert dataclasses.replace(again, d_ff=again.ffn_dim) == dataclasses.replace(cfg, d_ff=cfg.ffn_dim)


def test_the_rotary_rows_are_reordered_for_llama_cpp_and_back() -> None:
    """llama.cpp's llama pairs rows (2i, 2i+1) of each head where lmcli pairs (i, i + D/2);
    its qwen2 pairs them as lmcli does."""
    cfg = ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=8, position="rope")
    rows = torch.arange(cfg.n_embd + 2 * 4, dtype=torch.float32)  # q rows 0-7, k rows 8-11, v 12-15
    state = {"h.0.attn.c_attn.bias": rows}
    llama = FAMILIES["llama"].to_gguf(state, cfg)
    assert llama["blk.0.attn_q.bias"].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert llama["blk.0.attn_k.bias"].tolist() == [8, 10, 9, 11]
    assert FAMILIES["qwen2"].to_gguf(state, cfg)["blk.0.attn_q.bias"].tolist() == list(range(8))
    assert torch.equal(FAMILIES["llama"].from_gguf(llama, cfg)["h.0.attn.c_attn.bias"], rows)
