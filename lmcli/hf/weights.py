"""Reading a Hugging Face folder's weights and building our Transformer around them.

``read_weights`` opens ``model.safetensors`` or every shard named by
``model.safetensors.index.json`` with ``safetensors``' memory map: a tensor kept in its stored
dtype is a (private, copy-on-write) view of the file, so nothing is read twice and nothing is
copied; a tensor converted to another dtype is copied once. ``build_model`` makes the model on
the meta device and assigns those tensors to it, so no random weights are ever allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from lmcli.checkpoint import model_from_state, read_tensors
from lmcli.config import ModelConfig
from lmcli.errors import LmcliError
from lmcli.model import Transformer

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: one, or the shards its index names (each must exist)."""
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LmcliError(f"cannot read {path / INDEX}: {exc}") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise LmcliError(f"{path} is missing shard {missing[0]} (listed in {INDEX})")
        return [path / s for s in shards]
    raise LmcliError(f"{path} has no {SINGLE} (or {INDEX})")


def read_weights(path: Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Every tensor of the folder by its Hugging Face name, on the CPU; floating-point ones in
    ``dtype`` (None: as stored)."""
    if (
        not (path / SINGLE).is_file()
        and not (path / INDEX).is_file()
        and (path / "pytorch_model.bin").is_file()
    ):
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True)
        return {k: _as(v, dtype) for k, v in state.items()}
    out: dict[str, Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt"):  # checks the header and its offsets
                pass
            out.update(read_tensors(file, dtype))  # not memory-mapped (see read_tensors)
        except (SafetensorError, OSError, ValueError) as exc:
            raise LmcliError(f"cannot read weights {file}: {str(exc).splitlines()[0][:200]}") from None
    return out


def _as(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def build_model(cfg: ModelConfig, state: dict[str, Tensor], where: str) -> Transformer:
    """A Transformer of ``cfg`` holding ``state`` (our names, as on disk), its tensors assigned,
    not copied. One line naming what does not fit when ``state`` does not match ``cfg``."""
    return model_from_state(cfg, state, where).eval()
