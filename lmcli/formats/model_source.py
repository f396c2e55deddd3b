"""What a model source is, decided once: ``model_source(path)`` -> ``ModelSource``.

A command (and ``--init-from``, a LoRA run's base) names its model by a path; this module alone
says what the path holds, in this order:

- ``hf``: a local Hugging Face folder (``config.json`` with a ``model_type``, no ``meta.json``);
- ``gguf``: a GGUF file (its magic bytes);
- ``run`` / ``checkpoint``: an lmcli run folder (read: its ``best``, else ``last``) or one
  checkpoint folder; ``lora``: either of them holding LoRA adapters instead of weights;
- no path at all: the newest run under ``checkpoints/`` (``find_latest_run``).

A path that is none of them is one line (``resolve_checkpoint``'s: no such run or checkpoint
folder, not an lmcli run or checkpoint folder). What the source holds is answered without
building a model: ``config()`` (its ``ModelConfig``, from configs or a header), ``tokenizer()``, ``digests()``
(the sha256 of its weight files, which a LoRA run records of its base) and ``tensors()`` (its
weights under lmcli's names, one at a time, for a reader that never holds the whole model).
Loading a model is ``lmcli.formats.sources`` (``load_model``), by the source's kind.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    ADAPTERS,
    META,
    WEIGHTS,
    read_configs,
    read_json,
    resolve_checkpoint,
    sha256_of,
)
from lmcli.formats.gguf.load import is_gguf_file, read_gguf_header
from lmcli.formats.hf.load import is_hf_folder, open_hf_folder, read_blocks, read_hf_config
from lmcli.formats.weights import check_header, read_header, read_tensors
from lmcli.safe_io import checked_file
from lmcli.text.tokenizer import Tokenizer

Kind = Literal["hf", "gguf", "run", "checkpoint", "lora"]
GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")  # the block number of a GGUF tensor's name


@dataclass(frozen=True)
class ModelSource:
    """A model source as ``model_source`` found it: its ``kind``, the ``path`` it was named by,
    and for an lmcli run, checkpoint or LoRA run the checkpoint folder that is read."""

    kind: Kind
    path: Path
    checkpoint: Path | None = None

    @property
    def folder(self) -> Path:
        """What is read: the checkpoint folder of a run, else the path itself."""
        return self.checkpoint or self.path

    def config(self) -> ModelConfig:
        """The ModelConfig of the model (as loading would build it), from its configs or header
        alone: nothing is built and no weight is read."""
        if self.kind == "hf":
            return read_hf_config(self.path)[2]
        if self.kind == "gguf":
            return read_gguf_header(self.path).config
        return read_configs(self.folder, verify=False)[1]

    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, from its files or header alone (no weight is read)."""
        if self.kind == "hf":
            return open_hf_folder(self.path).tokenizer
        if self.kind == "gguf":
            return read_gguf_header(self.path).tokenizer
        return read_configs(self.folder, verify=False)[3]

    def digests(self) -> dict[str, str]:
        """The sha256 of each weight file: a GGUF file's own, an lmcli checkpoint's
        ``model.safetensors`` (as its meta.json records it, which loading verifies), a Hugging
        Face folder's ``*.safetensors`` and ``*.bin`` files."""
        path = self.folder
        if self.kind == "gguf":
            return {path.name: sha256_of(checked_file(path))}
        if (path / META).exists():
            recorded = read_json(path / META, "checkpoint metadata").get("sha256", {})
            digest = recorded.get(WEIGHTS) if isinstance(recorded, dict) else None
            return {WEIGHTS: digest if isinstance(digest, str) else sha256_of(checked_file(path / WEIGHTS))}
        files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
        return {p.name: sha256_of(checked_file(p)) for p in files}

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """The weights under lmcli's names as a checkpoint stores them (logical vocabulary, a
        tied head once), each with its name, in ``dtype`` (None: as stored; a GGUF file's
        quantized tensors in float32): a checkpoint's one tensor at a time, a Hugging Face
        folder's and a GGUF file's one block at a time (a block's query, key and value are
        mapped together). Every header is checked against the config first, as loading checks
        it; a LoRA run's weights are its base's with the adapters folded in, read whole by
        ``lmcli.formats.sources.load_model``."""
        if self.kind == "hf":
            for block in read_blocks(open_hf_folder(self.path), dtype):
                yield from block.items()
        elif self.kind == "gguf":
            yield from _gguf_tensors(self.path, dtype)
        elif self.kind == "lora":
            raise LmcliError(
                f"{self.path} is a LoRA run: its weights are read whole (lmcli export --merge "
                f"{self.path} --format lmcli OUT folds them into a checkpoint that streams)"
            )
        else:
            weights = checked_file(self.folder / WEIGHTS)
            header = read_header(weights)
            check_header(read_configs(self.folder, verify=True)[1], header)
            for name in header.tensors:
                yield name, read_tensors(weights, dtype, {name})[name]


def model_source(
    path: str | Path | ModelSource | None, missing: str = "run or checkpoint folder"
) -> ModelSource:
    """What ``path`` holds (see the module doc; None: the newest run under ``checkpoints/``; a
    ``ModelSource``: itself). ``missing``: what a path that does not exist is said not to be."""
    if isinstance(path, ModelSource):
        return path
    path = Path(path) if path is not None else find_latest_run(Path("checkpoints"))
    if is_hf_folder(path):
        return ModelSource("hf", path)
    if is_gguf_file(path):
        return ModelSource("gguf", path)
    if not path.exists():
        raise LmcliError(f"no such {missing}: {path}")
    ckpt = resolve_checkpoint(path)
    if os.path.lexists(ckpt / ADAPTERS):
        return ModelSource("lora", path, ckpt)
    return ModelSource("checkpoint" if ckpt == path else "run", path, ckpt)


def find_latest_run(root: str | Path = "checkpoints") -> Path:
    """The most recently written run folder under ``root``."""
    root = Path(root)
    runs = [p for p in root.glob("*/last") if (p / META).exists()] if root.is_dir() else []
    if not runs:
        raise LmcliError(f"no run found under {root}/: give a run folder, or train one with `lmcli train`")
    return max(runs, key=lambda p: (p / META).stat().st_mtime).parent


def _gguf_tensors(path: Path, dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """A GGUF file's tensors dequantized a block at a time (``load_gguf``'s values: matrices in
    ``dtype``, vectors as stored until the adapter's map is done), under lmcli's names."""
    header = read_gguf_header(path)
    groups: dict[int | None, list[str]] = {}
    for name in header.tensors:
        found = GGUF_BLOCK.match(name)
        groups.setdefault(int(found.group(1)) if found else None, []).append(name)
    for names in groups.values():
        stored = {n: header.tensors[n] for n in names}
        state = {n: t.dequantized(dtype if len(t.shape) > 1 else None) for n, t in stored.items()}
        for name, value in header.family.from_gguf(state, header.config).items():
            yield name, value.to(dtype) if dtype is not None else value
