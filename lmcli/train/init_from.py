"""What ``--init-from`` names, opened for training: a Hugging Face folder, a GGUF file or an lmcli
run or checkpoint folder (a LoRA run's adapters merged), in float32 as every model trains.

``open_init`` reads the config and tokenizer first; ``Init.load`` then gives the model: whole, or,
for a Hugging Face folder whose model will be sharded (``--parallel fsdp``), built on the meta
device with what reads each process's rows of its weights, one block at a time
(``lmcli.train.parallel.fill_from_hf``), so no process ever holds the whole model.

A ``block_size`` below the model's context cuts it (the run trains and stores that context: the
same weights, learned positions cut to their first rows); above it, the model keeps its own, and
a note says so.

A distillation student may start from its teacher instead (``open_cut``: ``--init-from-teacher-
layers``, ``--student-layers``): the teacher's embedding, the chosen blocks renumbered in order,
its final norm and head, read from lmcli's own names of any source's weights (``cut_state``), so
every family lmcli reads can be cut, one block's tensors at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.gguf.load import load_gguf
from lmcli.formats.hf.load import load_hf_folder, open_hf_folder
from lmcli.formats.model_source import ModelSource, model_source
from lmcli.formats.sources import load_checkpoint
from lmcli.formats.weights import model_from_state, with_context
from lmcli.model.skeleton import skeleton
from lmcli.model.transformer import Transformer
from lmcli.train.parallel import Fill, fill_from_hf

Load = Callable[[bool], tuple[Transformer, Fill | None]]


@dataclass
class Init:
    """An opened ``--init-from``: the config the run trains (its context cut to the run's block
    size), the tokenizer, and ``load(meta)``: the model and, when built on the meta device, what
    puts its weights in once it is placed."""

    config: ModelConfig
    tokenizer: Any
    load: Load


def init_source(path: str | Path | ModelSource) -> ModelSource:
    """What ``--init-from`` names (``model_source``; a path that does not exist is no Hugging Face
    model folder, as the option has always said)."""
    return model_source(path, missing="Hugging Face model folder")


def open_init(
    init: str | Path | ModelSource, info: Callable[[str], None], block_size: int | None = None
) -> Init:
    """``init`` (a source, or the path that names it) opened for training with a context of
    ``block_size`` (None: the model's own)."""
    source = init_source(init)
    if source.kind == "gguf":
        model, tok, _ = load_gguf(source.path, torch.float32)
        return _whole(model, tok, source.path, info, block_size)
    if source.kind != "hf":
        ckpt = load_checkpoint(source.path)
        return _whole(ckpt.model.float(), ckpt.tokenizer, source.path, info, block_size)
    path = source.path
    folder = open_hf_folder(path)
    config = _fitted_config(folder.config, block_size)

    def load(meta: bool) -> tuple[Transformer, Fill | None]:
        if not meta:
            model = load_hf_folder(path, torch.float32, info)[0]
            return _fitted(model, path, info, block_size), None
        for note in folder.notices:
            info(f"warning: {folder.path}: {note}")
        _note_context(folder.config, path, info, block_size)
        model = skeleton(config)
        return model, lambda placed: fill_from_hf(placed, folder)

    return Init(config, folder.tokenizer, load)


def _whole(
    model: Transformer, tok: Any, path: Path, info: Callable[[str], None], block_size: int | None
) -> Init:
    model = _fitted(model, path, info, block_size)
    return Init(model.config, tok, lambda meta: (model, None))


def _fitted_config(cfg: ModelConfig, block_size: int | None) -> ModelConfig:
    return (
        replace(cfg, block_size=block_size) if block_size is not None and block_size < cfg.block_size else cfg
    )


def _note_context(cfg: ModelConfig, path: Path, info: Callable[[str], None], block_size: int | None) -> None:
    if block_size is not None and block_size > cfg.block_size:
        context = cfg.block_size
        info(f"note: {path} has a context of {context} tokens: block size {context}, not {block_size}")


def _fitted(
    model: Transformer, path: Path, info: Callable[[str], None], block_size: int | None
) -> Transformer:
    """``model`` with the run's context: cut to ``block_size`` when that is shorter."""
    _note_context(model.config, path, info, block_size)
    if block_size is not None and block_size < model.config.block_size:
        return with_context(model, block_size)
    return model


BLOCK = re.compile(r"^h\.(\d+)\.")  # a block's tensor under lmcli's names


def spaced_layers(n_layer: int, count: int) -> tuple[int, ...]:
    """``count`` of ``n_layer`` blocks, evenly spaced, the first and the last among them."""
    if count == 1:
        return (0,)
    return tuple(int(i * (n_layer - 1) / (count - 1) + 0.5) for i in range(count))  # halves up


def chosen_layers(layers: tuple[int, ...], count: int, n_layer: int, where: str) -> tuple[int, ...]:
    """The teacher's blocks a student starts from: ``layers`` as given, else ``count`` evenly
    spaced; one line when a number is no block of the teacher, repeated or out of order."""
    if count:
        if count > n_layer:
            raise LmcliError(f"--student-layers {count}: the teacher {where} has {n_layer} blocks")
        return spaced_layers(n_layer, count)
    given = ",".join(map(str, layers))
    if any(i >= n_layer for i in layers):
        raise LmcliError(
            f"--init-from-teacher-layers {given}: the teacher {where} has blocks 0 to {n_layer - 1}"
        )
    if list(layers) != sorted(set(layers)):
        raise LmcliError(f"--init-from-teacher-layers {given}: give each block once, in increasing order")
    return layers


def cut_config(cfg: ModelConfig, layers: tuple[int, ...]) -> ModelConfig:
    """The teacher's shape with only ``layers``: each keeps its kind (local or global, rotary or
    not), so the patterns are spelled out block by block."""
    local = "".join("L" if cfg.is_local(i) else "G" for i in layers) if cfg.layer_pattern else ""
    rotary = "".join("R" if cfg.is_rotary(i) else "N" for i in layers) if cfg.rope_pattern else ""
    return replace(cfg, n_layer=len(layers), layer_pattern=local, rope_pattern=rotary)


def cut_state(
    tensors: Iterable[tuple[str, torch.Tensor]], layers: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """The tensors of the kept blocks renumbered (block ``layers[j]`` becomes ``j``) and every
    tensor of no block (embedding, positions, final norm, head); the others are never kept."""
    renumber = {old: new for new, old in enumerate(layers)}
    state: dict[str, torch.Tensor] = {}
    for name, value in tensors:
        found = BLOCK.match(name)
        if found is None:
            state[name] = value
        elif int(found.group(1)) in renumber:
            state[f"h.{renumber[int(found.group(1))]}.{name[found.end() :]}"] = value
    return state


def open_cut(
    source: ModelSource,
    layers: tuple[int, ...],
    count: int,
    info: Callable[[str], None],
    block_size: int | None,
) -> Init:
    """A student made of its teacher's blocks (``chosen_layers``), read from ``source`` in
    float32 (a quantized teacher's blocks dequantized)."""
    teacher = source.config()
    kept = chosen_layers(layers, count, teacher.n_layer, str(source.path))
    config = cut_config(teacher, kept)
    model = model_from_state(config, cut_state(source.tensors(torch.float32), kept), str(source.path))
    blocks = ",".join(map(str, kept))
    info(f"student: blocks {blocks} of the teacher's {teacher.n_layer}, its embedding and head")
    return _whole(model, source.tokenizer(), source.path, info, block_size)
