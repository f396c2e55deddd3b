"""The family registry: which family export writes a model as (each family's ``claims``, asked in
``export_rank`` order), which reads a GGUF architecture, and a family added as one module."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families import (
    ADAPTERS,
    FAMILIES,
    HFConfig,
    Registry,
    discover,
    for_export,
    from_gguf_arch,
)

ROPE = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False)
GEMMA = dict(
    ROPE, norm="rmsnorm1p", mlp="geglu", norm_placement="sandwich", qk_norm=True, scale_embeddings=True
)
WINDOW = dict(sliding_window=8)

# a model -> the family Hugging Face export writes it as, and GGUF export ("!": refused by it)
CHOICES = [
    (dict(), "gpt2", "gpt2"),  # lmcli's default: learned positions, LayerNorm, GELU, biases
    (dict(position="alibi", norm="rmsnorm", mlp="swiglu", bias=False), "!llama", "!gpt2"),
    (ROPE, "llama", "llama"),
    (dict(ROPE, qkv_bias=True), "qwen2", "llama"),  # llama.cpp's llama reads the biases
    (dict(ROPE, **WINDOW), "mistral", "llama"),  # GGUF: the context capped at the window
    (dict(ROPE, **WINDOW, layer_pattern="LG"), "qwen2", "!llama"),
    (dict(ROPE, qk_norm=True), "qwen3", "qwen3"),
    (dict(ROPE, qk_norm=True, qkv_bias=True), "!qwen3", "!qwen3"),
    (dict(ROPE, rope_pattern="RRRN"), "smollm3", "smollm3"),
    (dict(ROPE, rope_pattern="RRRN", qk_norm=True), "!smollm3", "!smollm3"),
    (GEMMA, "gemma3_text", "gemma3_text"),
    (dict(GEMMA, norm="rmsnorm"), "!gemma3_text", "!gemma3_text"),  # sandwich norms claim it
    (dict(ROPE, mlp="relu2"), "!llama", "!llama"),  # no family holds a ReLU^2 MLP
]


@pytest.mark.parametrize(("fields", "hf", "gguf"), CHOICES, ids=[f"{c[1]}-{c[2]}" for c in CHOICES])
def test_export_writes_a_model_as_the_first_family_that_claims_it(fields: dict, hf: str, gguf: str) -> None:
    cfg = ModelConfig(vocab_size=32, n_layer=4, n_head=2, n_embd=32, **fields)
    for fmt, want in (("hf", hf), ("gguf", gguf)):
        asked = sorted(FAMILIES.values(), key=lambda f: f.export_rank)
        claimed = next(f for f in asked if f.claims(cfg, fmt))
        assert claimed.name == want.removeprefix("!"), fmt
        if want.startswith("!"):  # the claiming family names what it cannot express
            with pytest.raises(LmcliError) as refused:
                for_export(cfg, fmt)
            assert str(refused.value) == claimed.refusal(claimed.problems(cfg, fmt), fmt)
        else:
            assert for_export(cfg, fmt) is claimed


def test_every_family_has_an_export_rank_of_its_own() -> None:
    ranks = [f.export_rank for f in FAMILIES.values()]
    assert len(set(ranks)) == len(ranks) == len(FAMILIES)
    assert max(FAMILIES.values(), key=lambda f: f.export_rank).name == "llama"  # asked last: claims all


def test_a_gguf_architecture_is_read_by_the_family_the_others_derive_from() -> None:
    """llama.cpp writes Mistral models as ``llama``: the Llama adapter reads them; a multimodal
    Gemma 3 folder's reader reads no GGUF file (a gemma3 file is the text model)."""
    assert from_gguf_arch("llama", "test").name == "llama"
    assert from_gguf_arch("gemma3", "test").name == "gemma3_text"
    with pytest.raises(LmcliError, match=r"unsupported GGUF architecture 'mamba' \(lmcli reads gemma3, gpt2"):
        from_gguf_arch("mamba", "m.gguf")


# a family lmcli does not have: Arcee (Llama with a gateless ReLU^2 MLP), as docs/architecture.md
# shows it; written into a package of its own, it is found without any other line changed
ARCEE = """
from lmcli.config.model import ModelConfig
from lmcli.formats.families.adapter import Format
from lmcli.formats.families.llama import Llama


class Arcee(Llama):
    name = "arcee"
    architecture = "ArceeForCausalLM"
    gguf_arch = "arcee"
    export_rank = 35
    mlp = "relu2"
    activation = "relu2"
    hf_names = tuple(e for e in Llama.hf_names if e.ours != "h.{i}.mlp.c_gate")
    gguf_names = tuple(e for e in Llama.gguf_names if e.ours != "h.{i}.mlp.c_gate")

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return cfg.mlp == "relu2"
"""


def test_a_family_is_one_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "more_families"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "arcee.py").write_text(textwrap.dedent(ARCEE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "more_families", raising=False)
    registry = Registry(ADAPTERS + discover("more_families"))
    assert [f.name for f in discover("more_families")] == ["arcee"]

    config = {
        "model_type": "arcee",
        "architectures": ["ArceeForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 32,
    }
    config |= {
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "hidden_act": "relu2",
    }
    hf = HFConfig(config, "config.json")
    family = registry.from_hf_config(hf)
    cfg, _ = family.config_from_hf(hf)
    assert (family.name, cfg.position, cfg.mlp) == ("arcee", "rope", "relu2")
    assert registry.for_export(cfg, "hf") is family and registry.for_export(cfg, "gguf") is family
    with pytest.raises(LmcliError, match="a relu2 MLP"):
        for_export(cfg, "hf")  # the registry lmcli has: no family holds it
    written = family.hf_config(cfg, {"bos": 1, "eos": 2, "pad": None}, "float32")
    assert family.config_from_hf(HFConfig(written, "config.json"))[0] == cfg
