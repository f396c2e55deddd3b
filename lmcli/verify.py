"""`lmcli verify`: a run or checkpoint folder's structure, checked without building a model.

For every checkpoint (``last``, ``best``, ``step-N``, an interrupted swap's ``*.old``): no
symbolic links, the files present and regular, ``meta.json`` records a sha256 for each and
each matches, ``config.json`` holds valid configs, the safetensors header fits the model
config (names, shapes, dtypes, sizes; ``lmcli.checkpoint.check_header``), the tokenizer loads
and fits the vocabulary, and ``trainer_state.pt`` loads with ``weights_only`` (no code runs).
The first problem is an ``LmcliError`` naming it. What it cannot tell: whether the weights are
the ones that were trained (a checksum recomputed by whoever edited a file matches again).

A Hugging Face folder or a GGUF file, which ``sample``, ``eval`` and the rest also read, is
checked as they check it before building anything: its config or metadata through the family
adapter, its weights' names and shapes against that config, its tokenizer against the
vocabulary (``verify_import``).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcli.checkpoint import (
    ADAPTERS,
    BASE,
    CONFIG,
    META,
    STATE,
    TOKENIZER,
    WEIGHTS,
    check_header,
    checked_file,
    read_header,
    read_json,
    verify_checksums,
)
from lmcli.config import ModelConfig, TrainConfig, from_dict, stored_model_config
from lmcli.errors import LmcliError
from lmcli.lora_run import checked_base
from lmcli.safe_io import refuse_symlinks
from lmcli.tokenizer import Tokenizer

REQUIRED = (WEIGHTS, CONFIG, TOKENIZER)
REQUIRED_LORA = (ADAPTERS, BASE, CONFIG, TOKENIZER)  # a LoRA run's checkpoint: adapters and a base


@dataclass
class CheckpointReport:
    """What verifying one checkpoint folder found (it passed)."""

    path: Path
    step: int | None
    params: int
    files: int  # files whose checksum matched

    def line(self) -> str:
        step = f"step {self.step}" if self.step is not None else "no step"
        return f"ok  {self.path}: {step}, {self.params:,} parameters, {self.files} checksums match"


def verify_checkpoint(ckpt: Path) -> CheckpointReport:
    """Check one checkpoint folder; an ``LmcliError`` names the first problem."""
    refuse_symlinks(ckpt)
    meta = read_json(ckpt / META, "checkpoint metadata")
    verify_checksums(ckpt, meta)
    recorded = meta.get("sha256", {})
    lora = os.path.lexists(ckpt / ADAPTERS)
    for name in REQUIRED_LORA if lora else REQUIRED:
        checked_file(ckpt / name)
        if name not in recorded:
            raise LmcliError(f"{ckpt / META} records no checksum for {name}")
    model_config = read_configs(ckpt / CONFIG)
    if lora:  # the adapters' shapes are checked when they are put on the base
        header = read_header(ckpt / ADAPTERS)
        checked_base(ckpt, read_json(ckpt / BASE, "LoRA base reference"))
    else:
        header = read_header(ckpt / WEIGHTS)
        check_header(model_config, header)
    tokenizer = Tokenizer.load(ckpt / TOKENIZER)
    if tokenizer.vocab_size != model_config.vocab_size:
        raise LmcliError(
            f"tokenizer in {ckpt} has {tokenizer.vocab_size} tokens but the model expects "
            f"{model_config.vocab_size}"
        )
    if os.path.lexists(ckpt / STATE):
        try:
            with warnings.catch_warnings():  # about the pickle protocol of a foreign file
                warnings.simplefilter("ignore")
                state = torch.load(checked_file(ckpt / STATE), map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling refused or truncated file
            raise LmcliError(
                f"cannot read trainer state {ckpt / STATE}: {str(exc).splitlines()[0][:200]}"
            ) from None
        if not isinstance(state, dict):
            raise LmcliError(f"trainer state {ckpt / STATE} is not a table of tensors")
    step = meta.get("step")
    return CheckpointReport(ckpt, step if isinstance(step, int) else None, header.n_params, len(recorded))


def read_configs(path: Path) -> ModelConfig:
    """The model config of a ``config.json``, its train config checked too."""
    cfg = read_json(path, "config")
    if not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("train", {}), dict):
        raise LmcliError(f"{path} has no model config")
    from_dict(TrainConfig, cfg.get("train", {}), source=str(path))
    return stored_model_config(cfg["model"], source=str(path))


def checkpoints_of(path: Path) -> list[Path]:
    """The checkpoint folders of a run folder (or ``path`` itself when it is one)."""
    if os.path.lexists(path / META) or os.path.lexists(path / WEIGHTS):
        return [path]
    found = [
        p
        for p in sorted(path.iterdir())
        if p.is_dir() and not p.name.startswith(".") and os.path.lexists(p / META)
    ]
    if not found:
        raise LmcliError(f"{path} is not an lmcli run or checkpoint folder (no checkpoint with {META})")
    return found


@dataclass
class ImportReport:
    """What verifying a Hugging Face folder or a GGUF file found (it passed)."""

    path: Path
    what: str  # "Hugging Face llama folder", "GGUF llama file (Q8_0, F32)"
    params: int
    vocab: int

    def line(self) -> str:
        return f"ok  {self.path}: {self.what}, {self.params:,} parameters, {self.vocab} tokens"


def verify_import(path: Path) -> ImportReport:
    """Check a Hugging Face folder or a GGUF file as loading it would, without building it."""
    from lmcli.checkpoint import WeightsHeader, expected_weights
    from lmcli.hf.gguf_load import read_gguf_header

    if not os.path.isdir(path):
        header = read_gguf_header(path)
        kinds = ", ".join(sorted({t.kind for t in header.tensors.values()}))
        params = sum(math.prod(s) for _, s in expected_weights(header.config)[0].values())
        return ImportReport(
            path, f"GGUF {header.family.gguf_arch} file ({kinds})", params, header.tokenizer.vocab_size
        )
    from lmcli.hf.families import HFConfig, from_hf_config
    from lmcli.hf.load import read_json, read_tokenizer
    from lmcli.hf.weights import weight_files

    hf = HFConfig(read_json(path / CONFIG), str(path / CONFIG))
    family = from_hf_config(hf)
    cfg = family.config_from_hf(hf)[0]
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        shapes |= {k: shape for k, (_, shape) in read_header(file).tensors.items()}
    mapped = family.from_hf({k: torch.empty(s, device="meta") for k, s in shapes.items()}, cfg)
    tensors = {k: ("F32", tuple(t.shape)) for k, t in mapped.items()}
    check_header(cfg, WeightsHeader(path, tensors, 0), any_dtype=True)
    tok = read_tokenizer(path, hf)
    if tok.vocab_size > cfg.vocab_size:
        raise LmcliError(f"tokenizer in {path} has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    params = sum(math.prod(s) for _, s in tensors.values())
    return ImportReport(path, f"Hugging Face {family.name} folder", params, tok.vocab_size)


def verify_run(path: str | Path) -> list[CheckpointReport | ImportReport]:
    """Check a run folder (its ``config.json`` and every checkpoint) or one checkpoint folder; a
    Hugging Face folder or a GGUF file as ``verify_import`` does."""
    from lmcli.hf.gguf_load import is_gguf_file
    from lmcli.hf.load import is_hf_folder

    path = Path(path)
    if not os.path.lexists(path):
        raise LmcliError(f"no such run or checkpoint folder: {path}")
    if is_gguf_file(path) or is_hf_folder(path):
        return [verify_import(path)]
    if not path.is_dir() or path.is_symlink():
        raise LmcliError(f"{path} is not a folder")
    refuse_symlinks(path)
    if os.path.lexists(path / CONFIG) and not os.path.lexists(path / META):  # a run's config
        read_configs(path / CONFIG)
    return [verify_checkpoint(ckpt) for ckpt in checkpoints_of(path)]
