"""One adapter per model family: everything lmcli knows of a family, in the family's own module.

An adapter (``adapter.FamilyAdapter``) holds the tensor-name maps to Hugging Face's and GGUF's
names and back (the fused query/key/value split, GPT-2's ``Conv1D`` transposes, llama.cpp's
rotary row order), the config both ways (``config.json`` -> ``ModelConfig`` with notices, and
back), ``problems(cfg, fmt)``: what the family cannot express (every export's error names them),
``claims(cfg, fmt)``: which models export writes as the family, and the GGUF architecture with its
metadata. Hugging Face import (``lmcli.formats.hf.load``), Hugging Face export
(``lmcli.formats.export.hf``), GGUF import (``lmcli.formats.gguf.load``) and GGUF export
(``lmcli.formats.export.gguf``) use nothing else.

The registry below collects the adapters where they are written: every ``FamilyAdapter``
subclass that a module of this package defines (``discover``). It picks the family once: from a
``config.json`` on import, from a ``ModelConfig`` on export (the families asked in
``export_rank`` order whether they claim it), from a GGUF architecture when a file is read.
Adding a family: its module here and a tiny folder builder in ``tests/formats/families.py``
(docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.adapter import FamilyAdapter, Format
from lmcli.formats.families.hf_config import HFConfig

__all__ = [
    "ADAPTERS",
    "ARCHITECTURES",
    "FAMILIES",
    "FamilyAdapter",
    "HFConfig",
    "Registry",
    "discover",
    "for_export",
    "from_gguf_arch",
    "from_hf_config",
]


def discover(package: str) -> tuple[FamilyAdapter, ...]:
    """One instance of every ``FamilyAdapter`` subclass the modules of ``package`` define, by
    module name, then in the order each module defines them."""
    found: list[FamilyAdapter] = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        found += [
            cls()
            for cls in vars(module).values()
            if inspect.isclass(cls)
            and issubclass(cls, FamilyAdapter)
            and cls.__module__ == module.__name__
            and cls is not FamilyAdapter
        ]
    return tuple(found)


@dataclass(frozen=True)
class Registry:
    """The adapters lmcli knows and the three questions asked of them."""

    adapters: tuple[FamilyAdapter, ...]

    @property
    def families(self) -> dict[str, FamilyAdapter]:
        """The families export writes, by ``model_type`` (each has a folder builder in the tests)."""
        return {f.name: f for f in self.adapters if f.export_rank is not None}

    def from_hf_config(self, hf: HFConfig) -> FamilyAdapter:
        """The family of a ``config.json`` (its ``model_type``, which every ``architectures``
        entry must agree with); one line naming an architecture lmcli lacks."""
        archs = hf.get("architectures") or []
        kind = hf.get("model_type")
        by_arch = {f.architecture: f for f in self.adapters}
        family = next((f for f in self.adapters if f.name == kind), None)
        if family is not None and all(by_arch.get(a) is family for a in archs):
            return family
        name = next((a for a in archs if a not in by_arch), None) or kind
        known = ", ".join(by_arch)
        raise LmcliError(f"{hf.where}: unsupported architecture {name!r} (lmcli imports {known})")

    def for_export(self, cfg: ModelConfig, fmt: Format) -> FamilyAdapter:
        """The family that writes ``cfg`` as ``fmt``: the first, in ``export_rank`` order, that
        claims it; one line naming what that family cannot express."""
        asked = sorted(self.families.values(), key=lambda f: f.export_rank or 0)
        family = next((f for f in asked if f.claims(cfg, fmt)), None)
        if family is None:  # the plain family (llama) claims every model: a bug, not bad input
            raise RuntimeError(f"no family claims this model for {fmt}")
        problems = family.problems(cfg, fmt)
        if problems:
            raise LmcliError(family.refusal(problems, fmt))
        return family

    def from_gguf_arch(self, arch: str, where: str) -> FamilyAdapter:
        """The family that reads GGUF files of architecture ``arch``: of those that write it, the
        one the others derive from (llama.cpp writes Mistral models as ``llama``: Llama reads
        them, as Mistral's ``config.json`` alone holds its window)."""
        readers = [f for f in self.adapters if f.gguf_arch and f.reads_gguf]
        candidates = [f for f in readers if f.gguf_arch == arch]
        if candidates:
            return min(candidates, key=lambda f: len(type(f).__mro__))
        known = ", ".join(dict.fromkeys(f.gguf_arch for f in readers if f.gguf_arch))
        raise LmcliError(f"{where}: unsupported GGUF architecture {arch!r} (lmcli reads {known})")


REGISTRY = Registry(discover(__name__))
ADAPTERS = REGISTRY.adapters
FAMILIES = REGISTRY.families
ARCHITECTURES = {f.architecture: f.name for f in FAMILIES.values()}


def from_hf_config(hf: HFConfig) -> FamilyAdapter:
    """The family of a ``config.json`` (``Registry.from_hf_config``)."""
    return REGISTRY.from_hf_config(hf)


def for_export(cfg: ModelConfig, fmt: Format) -> FamilyAdapter:
    """The family that writes ``cfg`` as ``fmt`` (``Registry.for_export``)."""
    return REGISTRY.for_export(cfg, fmt)


def from_gguf_arch(arch: str, where: str) -> FamilyAdapter:
    """The family that reads GGUF files of architecture ``arch`` (``Registry.from_gguf_arch``)."""
    return REGISTRY.from_gguf_arch(arch, where)
