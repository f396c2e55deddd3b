"""The checkpoint format: the only module that writes run folders, and the one that reads their files.

A run folder holds ``last/``, ``best/`` and optional ``step-NNNNNNN/`` checkpoints, plus
``metrics.jsonl`` and ``loss.png``. Each checkpoint folder is self-contained::

    model.safetensors   weights (tied head stored once)
    config.json         {"model": ModelConfig, "train": TrainConfig, "lmcli_version": ...}
    tokenizer.json      the tokenizer
    trainer_state.pt    optimizer, RNG states, data position (tensors/lists only)
    meta.json           step, metrics, sha256 of every file above

A sharded run's checkpoint (``--parallel fsdp``) holds the shards of its training state
(``SHARD_INDEX`` and one ``__<rank>_0.distcp`` file per process: ``lmcli.train.sharded``) in
place of ``trainer_state.pt``, beside the same whole weights, configs and tokenizer.

A LoRA run's checkpoint holds ``adapters.safetensors`` (the adapters and any other trained
tensor) and ``base.json`` (the base model's folder and the sha256 of its weight files) in place
of ``model.safetensors``; ``lmcli.formats.lora_base`` checks the base and puts the adapters on.

Writes go to a fresh private temporary folder (``lmcli.safe_io``) that is flushed and renamed
into place, so a crash leaves the previous checkpoint intact and a planted link is never written
through. A checkpoint folder is never changed once in place, only replaced whole; a reader that
sees it replaced while reading reads again (``read_consistently``). Reading verifies checksums,
checks the weights' header against the config before a model is built (``check_header``) and
never unpickles arbitrary objects. What a command is given as its model (a run folder, a
Hugging Face folder, a LoRA run, the newest run) is opened by ``lmcli.formats.sources``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from lmcli import __version__
from lmcli.config.files import from_dict, stored_fields, stored_model_config, to_dict
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.weights import model_state, unwrap
from lmcli.model import lora
from lmcli.model.transformer import Transformer
from lmcli.safe_io import checked_file, temp_dir
from lmcli.text.tokenizer import Tokenizer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
STATE = "trainer_state.pt"
META = "meta.json"
ADAPTERS = "adapters.safetensors"  # a LoRA run's trained tensors
BASE = "base.json"  # a LoRA run's base model: {"path": folder, "sha256": {weight file: digest}}
# a sharded checkpoint's index (torch.distributed.checkpoint's), beside one shard file per process
# (``__<rank>_0.distcp``) in place of trainer_state.pt: lmcli.train.sharded
SHARD_INDEX = ".metadata"
OLD = ".old"  # a checkpoint moved aside while its successor is renamed into place
STEP = re.compile(r"step-(\d+)")
READ_TRIES = 5  # reads of a checkpoint that a writer keeps replacing, before giving up


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
    base: dict[str, Any] | None = None  # a LoRA run's base reference (BASE), else None


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes, as hex."""
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


def _remove(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a folder; nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _commit(tmp: Path, dest: Path) -> None:
    """Flush ``tmp`` and move it to ``dest``, replacing an existing ``dest`` folder.

    There is always a whole checkpoint at ``dest`` or, between the two renames, at ``dest.old``;
    a ``dest.old`` is removed only once ``dest`` holds the newer one.
    """
    for child in tmp.iterdir():
        with open(child, "rb+") as f:
            os.fsync(f.fileno())
    os.chmod(tmp, tmp.parent.stat().st_mode & 0o777)  # the run folder's mode, not mkdtemp's 0700
    _fsync_dir(tmp)
    old = dest.with_name(dest.name + OLD)
    if os.path.lexists(dest):
        _remove(old)  # ``dest`` is whole: an older ``.old`` is stale
        os.replace(dest, old)  # until the next rename, loading falls back to ``.old``
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    _remove(old)


def save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors``' ``save_file``, its I/O errors as ``OSError`` (a full disk is ENOSPC, as a
    Python write would say, not a ``SafetensorError`` naming Rust's error kinds)."""
    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        code = re.search(r"(?:code: |os error )(\d+)", str(exc))
        if code is None:
            raise OSError(str(exc).splitlines()[0][:200]) from None
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from None


def save_checkpoint(
    dest: Path,
    model: torch.nn.Module,
    train_config: TrainConfig,
    tokenizer: Tokenizer,
    *,
    meta: dict[str, Any],
    state: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> None:
    """Atomically write a checkpoint folder at ``dest``; for a model with LoRA adapters, the
    adapters and ``base`` (``lora_base.base_reference``) instead of the weights."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(dest)  # created exclusively: a planted link at any name is never followed
    try:
        write_files(tmp, model, train_config, tokenizer, state=state, base=base)
        commit_checkpoint(tmp, dest, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_files(
    folder: Path,
    model: torch.nn.Module,
    train_config: TrainConfig,
    tokenizer: Tokenizer,
    *,
    state: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
    gathered: dict[str, torch.Tensor] | None = None,
) -> None:
    """A checkpoint's files but ``meta.json`` into ``folder``: the weights (of ``gathered``,
    the whole state dict, when the model's parameters are sharded), configs, tokenizer and
    the trainer ``state`` if given."""
    if lora.has_adapters(unwrap(model)):
        if base is None:
            raise ValueError("a model with adapters is saved with its base reference")
        adapters = lora.adapter_state(unwrap(model), gathered)
        save_tensors(adapters, folder / ADAPTERS)
        _write_json(folder / BASE, base)
    else:
        save_tensors(model_state(model, gathered), folder / WEIGHTS)
    _write_json(
        folder / CONFIG,
        {
            "model": to_dict(unwrap(model).config),
            "train": to_dict(train_config),
            "lmcli_version": __version__,
        },
    )
    tokenizer.save(folder / TOKENIZER)
    if state is not None:
        torch.save(state, folder / STATE)


def commit_checkpoint(tmp: Path, dest: Path, meta: dict[str, Any]) -> None:
    """``meta.json`` (``meta`` and the sha256 of every file in ``tmp``), then ``tmp`` flushed
    and renamed to ``dest``, replacing the checkpoint there."""
    files = sorted(p.name for p in tmp.iterdir())
    _write_json(tmp / META, {**meta, "sha256": {n: sha256_of(tmp / n) for n in files}})
    _commit(tmp, dest)


def is_sharded(ckpt: Path) -> bool:
    """Whether a checkpoint folder holds its training state as shards (a ``--parallel fsdp`` run's)."""
    return os.path.lexists(Path(ckpt) / SHARD_INDEX)


def copy_checkpoint(src: Path, dest: Path, *, link: bool = True) -> None:
    """Atomically copy a checkpoint folder: hard links where the filesystem allows (``link``, within
    a run: files are never changed in place), else copies. Only regular files are copied."""
    tmp = temp_dir(dest)
    try:
        for child in sorted(Path(src).iterdir()):
            if child.is_symlink() or not child.is_file():
                raise LmcliError(f"{child} is not a regular file: a checkpoint holds files only")
            if link:
                _link_or_copy(str(child), str(tmp / child.name))
            else:
                shutil.copy2(child, tmp / child.name)
        _commit(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst)


def step_checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's ``step-N`` checkpoint folders, oldest step first (by number, not by name)."""
    found = []
    for path in Path(run_dir).iterdir():
        match = STEP.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def recover_checkpoints(run_dir: Path) -> None:
    """Finish swaps a crash interrupted: ``X.old`` beside a whole ``X`` is stale and removed; an
    ``X.old`` alone (killed between the two renames) becomes ``X`` again. For a run's writer."""
    for old in Path(run_dir).glob(f"*{OLD}"):
        if not old.is_dir() or old.is_symlink():
            continue
        dest = old.with_name(old.name[: -len(OLD)])
        if (dest / META).exists():
            shutil.rmtree(old)
        elif not os.path.lexists(dest):
            os.replace(old, dest)


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


JSON_LIMIT = 64 << 20  # config.json and meta.json are a few KiB; more is not an lmcli file


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from a run folder's file; one line if it is not one."""
    try:
        if checked_file(path).stat().st_size > JSON_LIMIT:
            raise LmcliError(f"cannot read {what} {path}: larger than {JSON_LIMIT >> 20} MiB")
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise LmcliError(f"cannot read {what} {path}: {reason}") from None
    if not isinstance(data, dict):
        raise LmcliError(f"cannot read {what} {path}: not a JSON object")
    return data


def verify_checksums(ckpt: Path, meta: dict[str, Any]) -> None:
    """Compare each file with the sha256 recorded at save time; name the broken one."""
    recorded = meta.get("sha256", {})
    if not isinstance(recorded, dict):
        raise LmcliError(f"{ckpt / META}: sha256 is not a table of file names")
    for name, digest in recorded.items():
        if not isinstance(digest, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise LmcliError(f"{ckpt / META}: bad sha256 entry {name!r}")
        f = ckpt / name
        if not os.path.lexists(f):
            raise LmcliError(f"checkpoint {ckpt} is missing {name}")
        if sha256_of(checked_file(f)) != digest:
            raise LmcliError(f"checkpoint file {f} is corrupt (checksum mismatch)")


def _version(path: str | Path) -> tuple[str, bytes, int] | None:
    """Which checkpoint ``path`` holds now: its folder, its meta.json (unique per save: it holds
    the save's time) and the folder's inode; None if there is none right now."""
    try:
        ckpt = resolve_checkpoint(path)
        return str(ckpt), (ckpt / META).read_bytes(), os.stat(ckpt).st_ino
    except (LmcliError, OSError):
        return None


def read_consistently(load: Callable[..., Checkpoint]) -> Callable[..., Checkpoint]:
    """``load(path, ...)`` that never returns a mix of two checkpoints: a writer replaces a
    checkpoint folder whole (``_commit``), so if the folder ``path`` resolves to is the same before
    and after the read, every file came from it; if it changed, read again (a few times)."""

    @functools.wraps(load)
    def read(path: str | Path, *args: Any, **kwargs: Any) -> Checkpoint:
        for attempt in range(READ_TRIES):
            before = _version(path)
            try:
                result = load(path, *args, **kwargs)
            except (LmcliError, OSError):
                if _version(path) == before:
                    raise  # a real error, not a checkpoint replaced under the reader
            else:
                if _version(path) == before:
                    return result
            time.sleep(0.01 * (attempt + 1))
        raise LmcliError(f"{path} was replaced {READ_TRIES} times while being read: try again")

    return read


def read_configs(
    ckpt: Path, *, verify: bool = True
) -> tuple[dict[str, Any], ModelConfig, TrainConfig, Tokenizer]:
    """A checkpoint folder's metadata (``verify``: its files' checksums checked), model and
    training configs and tokenizer: everything but the weights."""
    meta = read_json(ckpt / META, "checkpoint metadata") if (ckpt / META).exists() else {}
    if verify:
        verify_checksums(ckpt, meta)
    cfg = read_json(ckpt / CONFIG, "checkpoint config")
    if not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("train", {}), dict):
        raise LmcliError(f"{ckpt / CONFIG} has no model config")
    model_config = stored_model_config(cfg["model"], source=str(ckpt / CONFIG))
    train_data = stored_fields(TrainConfig, dict(cfg.get("train", {})))  # no paths to write to
    train_config = from_dict(TrainConfig, train_data, source=str(ckpt / CONFIG))
    tokenizer = Tokenizer.load(checked_file(ckpt / TOKENIZER))
    padded = tokenizer.specials and tokenizer.vocab_size < model_config.vocab_size  # an imported model's
    if tokenizer.vocab_size != model_config.vocab_size and not padded:
        raise LmcliError(
            f"tokenizer in {ckpt} has {tokenizer.vocab_size} tokens but the model expects "
            f"{model_config.vocab_size}"
        )
    return meta, model_config, train_config, tokenizer


def read_trainer_state(ckpt: Path) -> dict[str, Any] | None:
    """``trainer_state.pt`` (tensors and lists only: nothing is unpickled), None if absent."""
    if not os.path.lexists(ckpt / STATE):
        return None
    checked_file(ckpt / STATE)
    try:
        return torch.load(ckpt / STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling refused or truncated file
        raise LmcliError(
            f"cannot read trainer state {ckpt / STATE}: {str(exc).splitlines()[0][:200]}"
        ) from None
