"""Model sources: what a command is given as its model, opened.

- an lmcli run folder (its ``best``, else ``last``) or checkpoint folder (``lmcli.formats.checkpoint``
  reads its files);
- a LoRA run: its base (an lmcli checkpoint or a Hugging Face folder, found unchanged by
  ``lmcli.formats.lora_base``) with the adapters put on, or merged into the weights;
- a local Hugging Face folder (``lmcli.formats.hf.load``);
- a GGUF file (``lmcli.formats.gguf.load``: llama.cpp's format, its tensors dequantized);
- nothing: the newest run under ``checkpoints/``.

``read_model_config`` answers what model a source holds (its ``ModelConfig``) from its configs
or header alone, without reading its weights.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from lmcli.config.files import replace_options
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    ADAPTERS,
    BASE,
    META,
    WEIGHTS,
    Checkpoint,
    read_configs,
    read_consistently,
    read_json,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from lmcli.formats.gguf.as_stored import load_gguf_as_stored
from lmcli.formats.gguf.load import is_gguf_file, load_gguf, read_gguf_header
from lmcli.formats.hf.load import is_hf_folder, load_hf_folder
from lmcli.formats.hf.load import read_json as read_hf_json
from lmcli.formats.lora_base import checked_base, load_adapted
from lmcli.formats.weights import load_weights
from lmcli.model.transformer import Transformer
from lmcli.safe_io import new_folder, write_error

# --dtype names of the commands that read a model
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@read_consistently
def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    *,
    with_state: bool = False,
    verify: bool = True,
    merge: bool = True,
) -> Checkpoint:
    """Load a checkpoint (or a run folder's best/last) with nothing but its folder; a LoRA run's
    base with its adapters merged into the weights, or (``merge=False``, to train on) put on."""
    ckpt = resolve_checkpoint(path)
    meta, model_config, train_config, tokenizer = read_configs(ckpt, verify=verify)
    base = None
    if os.path.lexists(ckpt / ADAPTERS):
        base = read_json(ckpt / BASE, "LoRA base reference")
        base_path = checked_base(ckpt, base)
        model = load_adapted(ckpt, base_path, base_model(base_path), model_config, train_config, merge=merge)
    else:
        model = load_weights(model_config, ckpt / WEIGHTS)
    model.to(device).eval()
    state = read_trainer_state(ckpt) if with_state else None
    return Checkpoint(ckpt, model, model_config, train_config, tokenizer, meta, state, base)


def base_model(path: Path) -> Transformer:
    """A LoRA run's base model: a Hugging Face folder or a GGUF file in float32 (as it was
    trained), or an lmcli checkpoint."""
    if is_hf_folder(path):
        return load_hf_folder(path, torch.float32, lambda msg: None)[0]
    if is_gguf_file(path):
        return load_gguf(path, torch.float32)[0]
    return load_checkpoint(path).model


def load_model(
    path: str | Path | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    as_stored: bool = False,
) -> Checkpoint:
    """What a command is given: an lmcli run or checkpoint folder, a local Hugging Face folder,
    a GGUF file, or (None) the newest run under ``checkpoints/``; in eval mode on ``device``,
    weights in ``dtype`` (None: as stored). ``as_stored``: a GGUF file's q8_0/q4_0/K-quant
    matrices stay in their blocks on a CPU, multiplied by the native kernels (inference only)."""
    path = Path(path) if path is not None else find_latest_run(Path("checkpoints"))
    if is_hf_folder(path):
        model, tok = load_hf_folder(path, dtype)
        model.to(device).eval()
        meta = {"source": "huggingface", "name": path.resolve().name}
        return Checkpoint(path, model, model.config, TrainConfig(), tok, meta)
    if is_gguf_file(path):
        blocks = as_stored and torch.device(device).type == "cpu"
        model, tok, meta = (load_gguf_as_stored if blocks else load_gguf)(path, dtype)
        model.to(device).eval()
        return Checkpoint(path, model, model.config, TrainConfig(), tok, meta)
    ckpt = load_checkpoint(path, device)
    if dtype is not None:
        ckpt.model.to(dtype)
    return ckpt


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the model ``path`` names (as ``load_model`` would load it), from its
    configs or header alone: nothing is built and no weight is read."""
    path = Path(path)
    if is_hf_folder(path):
        from lmcli.formats.families import HFConfig, from_hf_config

        hf = HFConfig(read_hf_json(path / "config.json"), str(path / "config.json"))
        return from_hf_config(hf).config_from_hf(hf)[0]
    if is_gguf_file(path):
        return read_gguf_header(path).config
    return read_configs(resolve_checkpoint(path), verify=False)[1]


def find_latest_run(root: str | Path = "checkpoints") -> Path:
    """The most recently written run folder under ``root``."""
    root = Path(root)
    runs = [p for p in root.glob("*/last") if (p / META).exists()] if root.is_dir() else []
    if not runs:
        raise LmcliError(f"no run found under {root}/: give a run folder, or train one with `lmcli train`")
    return max(runs, key=lambda p: (p / META).stat().st_mtime).parent


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write the model ``path`` names (a LoRA run's adapters merged) as a plain lmcli checkpoint
    folder ``out``, which must be new or empty."""
    out = new_folder(out)
    ckpt = load_model(path)
    train_config = replace_options(ckpt.train_config, lora_rank=0)  # plain weights now
    meta = {"step": ckpt.meta.get("step"), "exported_from": str(ckpt.path), "time": time.time()}
    if out.exists():
        out.rmdir()
    try:
        save_checkpoint(out, ckpt.model, train_config, ckpt.tokenizer, meta=meta)
    except OSError as exc:  # a full disk: named by OUT, not by the temporary folder
        raise LmcliError(f"cannot write {out}: {write_error(exc)}") from None
    return out
