"""One adapter per model family: everything lmcli knows of a family, in the family's own module.

An adapter (``adapter.FamilyAdapter``) holds the tensor-name maps to Hugging Face's and GGUF's
names and back (the fused query/key/value split, GPT-2's ``Conv1D`` transposes, llama.cpp's
rotary row order), the config both ways (``config.json`` -> ``ModelConfig`` with notices, and
back), ``problems(cfg, fmt)``: what the family cannot express (every export's error names them),
and the GGUF architecture with its metadata. Hugging Face import (``hf.load``), Hugging Face
export (``hf.export``) and GGUF export (``hf.gguf``) use nothing else.

The registry below picks the family once: from a ``config.json`` on import, from a
``ModelConfig`` on export, from a GGUF architecture when a file is read. Adding a family: a
module here, a line in ``FAMILIES``, and a tiny folder builder in ``tests/formats/families.py``.
"""

from __future__ import annotations

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.adapter import FamilyAdapter, Format
from lmcli.formats.families.gemma3 import Gemma3, Gemma3Multimodal
from lmcli.formats.families.gpt2 import GPT2
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.families.llama import Llama
from lmcli.formats.families.mistral import Mistral
from lmcli.formats.families.qwen2 import Qwen2
from lmcli.formats.families.qwen3 import Qwen3
from lmcli.formats.families.smollm3 import SmolLM3

FAMILIES: dict[str, FamilyAdapter] = {
    f.name: f for f in (GPT2(), Llama(), Qwen2(), Mistral(), Qwen3(), SmolLM3(), Gemma3())
}
# multimodal folders whose text tower is read (import only: export writes the text model's family)
MULTIMODAL: dict[str, FamilyAdapter] = {f.architecture: f for f in (Gemma3Multimodal(),)}
ARCHITECTURES = {f.architecture: f.name for f in FAMILIES.values()}

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "FamilyAdapter",
    "HFConfig",
    "for_export",
    "from_gguf_arch",
    "from_hf_config",
]


def from_hf_config(hf: HFConfig) -> FamilyAdapter:
    """The family of a ``config.json`` (its ``model_type``, which every ``architectures`` entry
    must agree with); one line naming an architecture lmcli lacks."""
    archs = hf.get("architectures") or []
    kind = hf.get("model_type")
    if archs and all(a in MULTIMODAL for a in archs) and kind == MULTIMODAL[archs[0]].name:
        return MULTIMODAL[archs[0]]
    if kind in FAMILIES and all(ARCHITECTURES.get(a) == kind for a in archs):
        return FAMILIES[kind]
    name = next((a for a in archs if a not in ARCHITECTURES), None) or kind
    raise LmcliError(
        f"{hf.where}: unsupported architecture {name!r} (lmcli imports {', '.join(ARCHITECTURES)})"
    )


def for_export(cfg: ModelConfig, fmt: Format) -> FamilyAdapter:
    """The family that writes ``cfg`` as ``fmt``, chosen by its positions; one line naming what
    that family cannot express.

    Hugging Face: learned -> gpt2; sandwich norms, (1 + weight) norms or GeGLU -> gemma3_text;
    layers without rotary -> smollm3; qk-norm -> qwen3; query/key/value biases or a sliding
    window on some layers -> qwen2; a window on every layer -> mistral; anything else -> llama.
    GGUF: learned (or any other non-rotary) positions -> gpt2; sandwich norms, (1 + weight) norms
    or GeGLU -> gemma3; layers without rotary -> smollm3; qk-norm -> qwen3; anything else -> llama
    (llama.cpp's ``llama`` reads biases where present).
    """
    if fmt == "hf":
        name = hf_family(cfg)
    else:
        name = gguf_family(cfg)
    family = FAMILIES[name]
    problems = family.problems(cfg, fmt)
    if problems:
        raise LmcliError(family.refusal(problems, fmt))
    return family


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face family that holds ``cfg`` (``for_export``'s order)."""
    if cfg.position == "learned":
        return "gpt2"
    if cfg.norm_placement == "sandwich" or cfg.norm == "rmsnorm1p" or cfg.mlp == "geglu":
        return "gemma3_text"
    if cfg.rope_pattern:
        return "smollm3"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias or cfg.layer_pattern:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


def gguf_family(cfg: ModelConfig) -> str:
    """The family whose GGUF architecture holds ``cfg`` (``for_export``'s order)."""
    if cfg.position != "rope":
        return "gpt2"
    if cfg.norm_placement == "sandwich" or cfg.norm == "rmsnorm1p" or cfg.mlp == "geglu":
        return "gemma3_text"
    if cfg.rope_pattern:
        return "smollm3"
    return "qwen3" if cfg.qk_norm else "llama"


def from_gguf_arch(arch: str, where: str) -> FamilyAdapter:
    """The family that reads GGUF files of architecture ``arch`` (the first registered: llama.cpp
    writes Mistral models as ``llama``)."""
    for family in FAMILIES.values():
        if family.gguf_arch == arch and family.reads_gguf:
            return family
    known = ", ".join(dict.fromkeys(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch and f.reads_gguf))
    raise LmcliError(f"{where}: unsupported GGUF architecture {arch!r} (lmcli reads {known})")
