"""A model to export, read a group of tensors at a time: what a streaming export needs.

``open_source`` reads what it can without the weights (config, tokenizer, name) and hands out
``groups()``: the weights under lmcli's names (as on disk, the vocabulary cut to its logical
size, the tied head left out), in float32, the tensors of no block first, then block 0, 1, ...
Only one group is in memory at a time:

- an lmcli run or checkpoint folder: its safetensors file, the tensors of a group read into
  memory of their own (``weights.read_tensors``) after the header is checked against the config;
- a Hugging Face folder: ``hf.load.read_blocks`` (the same reader ``--quantize`` loads with);
- a GGUF file: the tensors of a group dequantized from the file's memory map, then mapped to
  lmcli's names by the family adapter;
- a LoRA run (or a sharded checkpoint): loaded whole (the adapters merged), then handed out a
  group at a time (``model_source``: the model's own tensors, no copy).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.formats.checkpoint import ADAPTERS, WEIGHTS, is_sharded, read_configs, resolve_checkpoint
from lmcli.formats.gguf.load import GgufHeader, GgufTensor, is_gguf_file, read_gguf_header
from lmcli.formats.hf.load import is_hf_folder, open_hf_folder, read_blocks
from lmcli.formats.sources import load_model
from lmcli.formats.weights import check_header, clean_state_dict, logical_state, read_header, read_tensors
from lmcli.safe_io import checked_file
from lmcli.text.tokenizer import Tokenizer

_BLOCK = re.compile(r"^h\.(\d+)\.")  # lmcli's per-block names
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")
VOCABULARY = ("wte.weight", "lm_head.weight")


@dataclass
class ExportSource:
    """A model to export: what it is, and its weights a group at a time (``groups()``)."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    groups: Callable[[], Iterator[dict[str, Tensor]]]
    header: GgufHeader | None = None  # a GGUF file's: its tensors as stored, by GGUF name


def block_of(name: str, pattern: re.Pattern[str] = _BLOCK) -> int | None:
    """The block of a tensor's name, None for the tensors of no block."""
    found = pattern.match(name)
    return int(found.group(1)) if found else None


def in_groups(names: list[str], pattern: re.Pattern[str] = _BLOCK) -> list[list[str]]:
    """``names`` grouped: those of no block first, then block 0, 1, ..."""
    groups: dict[int, list[str]] = {}
    for name in names:
        block = block_of(name, pattern)
        groups.setdefault(-1 if block is None else block, []).append(name)
    return [groups[k] for k in sorted(groups)]


def logical(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A group as export writes it: the vocabulary's rows cut to the logical size, no tied head;
    matrices in float32, float16 or bfloat16 as they come (the quantizer reads each), vectors
    in float32."""
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if name in VOCABULARY and t.size(0) != cfg.vocab_size:
            t = t[: cfg.vocab_size]  # (padded V, C) -> (V, C)
        keep = t.dim() > 1 and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
        out[name] = t if keep else t.float()
    return out


def model_source(model: torch.nn.Module, tok: Tokenizer, name: str) -> ExportSource:
    """A model in memory as an export source (its tensors handed out without copies)."""
    cfg: ModelConfig = model.config

    def groups() -> Iterator[dict[str, Tensor]]:
        state = logical_state(model)
        for names in in_groups(list(state)):
            yield logical({k: state[k] for k in names}, cfg)

    return ExportSource(cfg, tok, name, groups)


def run_name(run_dir: str | Path) -> str:
    """A run folder's (or any folder's) name; ``RUN-best`` for a checkpoint inside one."""
    path = Path(run_dir).resolve()
    if path.name in ("best", "last") or path.name.startswith("step-"):
        return f"{path.parent.name}-{path.name}"
    return path.name


def open_source(path: str | Path) -> ExportSource:
    """The model ``path`` names (a run or checkpoint folder, a LoRA run, a Hugging Face folder, a
    GGUF file), its weights not read yet."""
    path = Path(path)
    if is_hf_folder(path):
        return _hf_source(path)
    if is_gguf_file(path):
        return _gguf_source(path)
    ckpt = resolve_checkpoint(path)
    if os.path.lexists(ckpt / ADAPTERS) or is_sharded(ckpt) or not (ckpt / WEIGHTS).exists():
        loaded = load_model(path)  # the adapters merged: the whole model, then its groups
        return model_source(loaded.model, loaded.tokenizer, loaded.meta.get("name") or run_name(path))
    meta, cfg, _, tok = read_configs(ckpt)
    weights = checked_file(ckpt / WEIGHTS)
    check_header(cfg, read_header(weights))  # (every name and shape, before a tensor is read)
    stored = {_clean(raw): raw for raw in read_header(weights).tensors}  # (a compiled model's prefixes)

    def groups() -> Iterator[dict[str, Tensor]]:
        for names in in_groups(list(stored)):
            state = read_tensors(weights, torch.float32, [stored[n] for n in names])
            yield logical(clean_state_dict(state), cfg)

    return ExportSource(cfg, tok, meta.get("name") or run_name(path), groups)


def _clean(name: str) -> str:
    """A stored tensor's name without ``_orig_mod.``/``module.`` prefixes."""
    return next(iter(clean_state_dict({name: torch.empty(0)})))


def _hf_source(path: Path) -> ExportSource:
    folder = open_hf_folder(path)

    def groups() -> Iterator[dict[str, Tensor]]:
        for state in read_blocks(folder, torch.float32):
            yield logical(state, folder.config)

    return ExportSource(folder.config, folder.tokenizer, path.resolve().name, groups)


def _gguf_source(path: Path) -> ExportSource:
    header = read_gguf_header(path)

    def groups() -> Iterator[dict[str, Tensor]]:
        for names in in_groups(list(header.tensors), _GGUF_BLOCK):
            state = {n: stored_values(header.tensors[n]) for n in names}
            yield logical(header.family.from_gguf(state, header.config), header.config)

    return ExportSource(header.config, header.tokenizer, header.name, groups, header)


def stored_values(t: GgufTensor) -> Tensor:
    """A GGUF tensor's values: an F32, F16 or BF16 matrix as stored (a view of the file), vectors
    and quantized matrices in float32."""
    return t.dequantized(None if len(t.shape) > 1 and not t.quantized else torch.float32)
