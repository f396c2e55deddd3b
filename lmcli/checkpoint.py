"""The checkpoint format and every model loader: the only module that reads or writes run folders.

A run folder holds ``last/``, ``best/`` and optional ``step-NNNNNNN/`` checkpoints, plus
``metrics.jsonl`` and ``loss.png``. Each checkpoint folder is self-contained::

    model.safetensors   weights (tied head stored once)
    config.json         {"model": ModelConfig, "train": TrainConfig, "lmcli_version": ...}
    tokenizer.json      the tokenizer
    trainer_state.pt    optimizer, RNG states, data position (tensors/lists only)
    meta.json           step, metrics, sha256 of every file above

Writes go to a temporary folder that is flushed and renamed into place, so a crash leaves the
previous checkpoint intact. Loading verifies checksums and never unpickles arbitrary objects.
``load_model`` opens what a command is given: a run folder, a checkpoint folder, a local Hugging
Face folder (``lmcli.hf``), or, given nothing, the newest run under ``checkpoints/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmcli import __version__
from lmcli.config import ModelConfig, TrainConfig, from_dict, to_dict
from lmcli.errors import LmcliError
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
STATE = "trainer_state.pt"
META = "meta.json"
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers
# parameters whose name in a checkpoint file differs from the module path (lmcli 0.1's names)
DISK_NAMES = {"positions.wpe.weight": "wpe.weight"}
MODULE_NAMES = {disk: module for module, disk in DISK_NAMES.items()}


@dataclass
class Checkpoint:
    """A loaded checkpoint: model (eval mode), configs, tokenizer, metadata, optional state."""

    path: Path
    model: Transformer
    model_config: ModelConfig
    train_config: TrainConfig
    tokenizer: Tokenizer
    meta: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] | None = None


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip ``_orig_mod.``/``module.`` prefixes so compiled or DDP models load anywhere."""
    out = {}
    for key, value in state.items():
        for prefix in _PREFIXES:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def unwrap(model: torch.nn.Module) -> Transformer:
    """The Transformer inside a ``torch.compile`` and/or DDP wrapper."""
    raw = getattr(model, "_orig_mod", model)
    return getattr(raw, "module", raw)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights to save: names as on disk, tied head stored once, contiguous CPU tensors."""
    raw = unwrap(model)
    state = clean_state_dict(raw.state_dict())
    if raw.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {DISK_NAMES.get(k, k): v.detach().to("cpu").contiguous() for k, v in state.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _commit(tmp: Path, dest: Path) -> None:
    """Flush ``tmp`` and move it to ``dest``, replacing an existing ``dest`` folder."""
    for child in tmp.iterdir():
        with open(child, "rb+") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = dest.with_name(dest.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        os.replace(dest, old)  # until the next rename, loading falls back to ``.old``
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    if old.exists():
        shutil.rmtree(old)


def save_checkpoint(
    dest: Path,
    model: torch.nn.Module,
    train_config: TrainConfig,
    tokenizer: Tokenizer,
    *,
    meta: dict[str, Any],
    state: dict[str, Any] | None = None,
) -> None:
    """Atomically write a checkpoint folder at ``dest``."""
    dest = Path(dest)
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_file(model_state(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
        _write_json(
            tmp / CONFIG,
            {
                "model": to_dict(unwrap(model).config),
                "train": to_dict(train_config),
                "lmcli_version": __version__,
            },
        )
        tokenizer.save(tmp / TOKENIZER)
        if state is not None:
            torch.save(state, tmp / STATE)
        files = sorted(p.name for p in tmp.iterdir())
        _write_json(tmp / META, {**meta, "sha256": {n: _sha256(tmp / n) for n in files}})
        _commit(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_checkpoint(src: Path, dest: Path) -> None:
    """Atomically copy a checkpoint folder (hard links where the filesystem allows)."""
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        _commit(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder for ``path``: itself, or a run folder's ``best``, then ``last``."""
    path = Path(path)
    if not path.exists():
        raise LmcliError(f"no such run or checkpoint folder: {path}")
    if (path / META).exists() or (path / WEIGHTS).exists():
        return path
    for name in ("best", "last", "best.old", "last.old"):
        if (path / name / META).exists():
            return path / name
    raise LmcliError(f"{path} is not an lmcli run or checkpoint folder (no {WEIGHTS})")


def last_checkpoint(run_dir: str | Path) -> Path:
    """The ``last`` checkpoint of a run (for resuming), recovering an interrupted swap."""
    run_dir = Path(run_dir)
    for name in ("last", "last.old"):
        if (run_dir / name / META).exists():
            return run_dir / name
    if not run_dir.exists():
        raise LmcliError(f"no such run folder: {run_dir}")
    raise LmcliError(f"{run_dir} has no checkpoint to resume from (no last/{META})")


def find_latest_run(root: str | Path = "checkpoints") -> Path:
    """The most recently written run folder under ``root``."""
    root = Path(root)
    runs = [p for p in root.glob("*/last") if (p / META).exists()] if root.is_dir() else []
    if not runs:
        raise LmcliError(f"no run found under {root}/: give a run folder, or train one with `lmcli train`")
    return max(runs, key=lambda p: (p / META).stat().st_mtime).parent


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise LmcliError(f"{path.parent} is missing {path.name}") from None
    except (OSError, ValueError) as exc:
        raise LmcliError(f"cannot read {what} {path}: {exc}") from None


def verify_checksums(ckpt: Path, meta: dict[str, Any]) -> None:
    """Compare each file with the sha256 recorded at save time; name the broken one."""
    for name, digest in meta.get("sha256", {}).items():
        f = ckpt / name
        if not f.exists():
            raise LmcliError(f"checkpoint {ckpt} is missing {name}")
        if _sha256(f) != digest:
            raise LmcliError(f"checkpoint file {f} is corrupt (checksum mismatch)")


def load_weights(model: Transformer, path: Path, device: torch.device | str = "cpu") -> None:
    """Load ``model.safetensors`` into ``model``; a clear error for truncated or foreign files."""
    try:
        state = clean_state_dict(load_file(str(path), device=str(device)))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LmcliError(f"cannot read weights {path}: {str(exc).splitlines()[0][:200]}") from None
    load_state(model, state, str(path))


def load_state(model: Transformer, state: dict[str, torch.Tensor], where: str) -> None:
    """Load weights named as on disk into ``model``; one line naming what does not fit."""
    state = {MODULE_NAMES.get(k, k): v for k, v in state.items()}
    if model.config.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("wte.weight"))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise LmcliError(
            f"weights {where} do not fit the model config "
            f"(missing: {', '.join(missing[:3]) or '-'}; unexpected: {', '.join(unexpected[:3]) or '-'})"
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise LmcliError(
                f"weights {where}: {key} has shape {tuple(value.shape)}, "
                f"config expects {tuple(expected[key].shape)}"
            )
    model.load_state_dict(state)


def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    *,
    with_state: bool = False,
    verify: bool = True,
) -> Checkpoint:
    """Load a checkpoint (or a run folder's best/last) with nothing but its folder."""
    ckpt = resolve_checkpoint(path)
    meta = read_json(ckpt / META, "checkpoint metadata") if (ckpt / META).exists() else {}
    if verify:
        verify_checksums(ckpt, meta)
    cfg = read_json(ckpt / CONFIG, "checkpoint config")
    if "model" not in cfg:
        raise LmcliError(f"{ckpt / CONFIG} has no model config")
    model_config = from_dict(ModelConfig, cfg["model"], source=str(ckpt / CONFIG))
    train_data = dict(cfg.get("train", {}))
    train_config = from_dict(TrainConfig, train_data, source=str(ckpt / CONFIG))
    tokenizer = Tokenizer.load(ckpt / TOKENIZER)
    padded = tokenizer.specials and tokenizer.vocab_size < model_config.vocab_size  # an imported model's
    if tokenizer.vocab_size != model_config.vocab_size and not padded:
        raise LmcliError(
            f"tokenizer in {ckpt} has {tokenizer.vocab_size} tokens but the model expects "
            f"{model_config.vocab_size}"
        )
    model = Transformer(model_config)
    load_weights(model, ckpt / WEIGHTS)
    model.to(device).eval()
    state = None
    if with_state and (ckpt / STATE).exists():
        try:
            state = torch.load(ckpt / STATE, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling refused or truncated file
            raise LmcliError(
                f"cannot read trainer state {ckpt / STATE}: {str(exc).splitlines()[0][:200]}"
            ) from None
    return Checkpoint(ckpt, model, model_config, train_config, tokenizer, meta, state)


def load_model(
    path: str | Path | None, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Checkpoint:
    """What a command is given: an lmcli run or checkpoint folder, a local Hugging Face folder,
    or (None) the newest run under ``checkpoints/``; in eval mode on ``device``, weights in
    ``dtype`` (None: as stored)."""
    from lmcli.hf import is_hf_folder, load_hf_folder

    path = Path(path) if path is not None else find_latest_run(Path("checkpoints"))
    if is_hf_folder(path):
        model, tok = load_hf_folder(path, dtype)
        model.to(device).eval()
        return Checkpoint(path, model, model.config, TrainConfig(), tok, {"source": "huggingface"})
    ckpt = load_checkpoint(path, device)
    if dtype is not None:
        ckpt.model.to(dtype)
    return ckpt
