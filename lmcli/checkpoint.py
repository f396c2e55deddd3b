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
of ``model.safetensors``; ``lmcli.lora_run`` checks the base and puts the adapters on.

Writes go to a fresh private temporary folder (``lmcli.safe_io``) that is flushed and renamed
into place, so a crash leaves the previous checkpoint intact and a planted link is never written
through. A checkpoint folder is never changed once in place, only replaced whole; a reader that
sees it replaced while reading reads again (``read_consistently``). Reading verifies checksums,
checks the weights' header against the config before a model is built (``check_header``) and
never unpickles arbitrary objects. What a command is given as its model (a run folder, a
Hugging Face folder, a LoRA run, the newest run) is opened by ``lmcli.sources``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from lmcli import __version__, lora
from lmcli.config import ModelConfig, TrainConfig, from_dict, stored_fields, stored_model_config, to_dict
from lmcli.errors import LmcliError, check_names
from lmcli.model import Transformer
from lmcli.safe_io import temp_dir
from lmcli.tokenizer import Tokenizer

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
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers
# parameters whose name in a checkpoint file differs from the module path (lmcli 0.1's names)
DISK_NAMES = {"positions.wpe.weight": "wpe.weight"}
MODULE_NAMES = {disk: module for module, disk in DISK_NAMES.items()}
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


def model_state(
    model: torch.nn.Module, gathered: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Weights to save: names as on disk, tied head stored once, contiguous CPU tensors (of
    ``gathered``, the model's whole state dict, when its parameters are sharded)."""
    raw = unwrap(model)
    state = clean_state_dict(raw.state_dict() if gathered is None else gathered)
    if raw.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {DISK_NAMES.get(k, k): v.detach().to("cpu").contiguous() for k, v in state.items()}


def logical_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model_state`` with the embedding table and the head cut to the logical vocabulary:
    what another format (Hugging Face, GGUF) holds, ``vocab_size`` rows and not the padding."""
    V = unwrap(model).config.vocab_size
    state = model_state(model)
    for key in ("wte.weight", "lm_head.weight"):
        if key in state and state[key].size(0) != V:
            state[key] = state[key][:V].contiguous()  # (padded V, C) -> (V, C)
    return state


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
    adapters and ``base`` (``lora_run.base_reference``) instead of the weights."""
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


def checked_file(path: Path) -> Path:
    """``path`` if it is a regular file, not a link: a run folder is input, and a link or a
    device there (``/dev/zero``) would make a reader hang or read outside the folder."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LmcliError(f"{path.parent} is missing {path.name}") from None
    except OSError as exc:
        raise LmcliError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise LmcliError(f"{path} is a symbolic link: a run folder must not contain links")
    if not stat.S_ISREG(st.st_mode):
        raise LmcliError(f"{path} is not a regular file")
    return path


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


# safetensors dtype names of the floating-point tensors lmcli reads (a model is built in float32)
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# what a model computes from its config alone (position tables, a full-context attention bias)
# may take the weights' size, or this much for small models with long contexts
COMPUTED_FLOOR = 256 << 20
_LAYER = re.compile(r"h\.(\d+)\.")


@dataclass
class WeightsHeader:
    """What the header of a safetensors file says, read without its tensors."""

    path: Path
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    file_size: int

    @property
    def n_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors.values())


def read_header(path: Path) -> WeightsHeader:
    """The tensor names, dtypes and shapes of ``path`` from its header alone (safetensors checks
    that the offsets are in order and cover the file exactly)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {}
            for name in f.keys():
                piece = f.get_slice(name)
                tensors[name] = (piece.get_dtype(), tuple(piece.get_shape()))
        size = path.stat().st_size
    except FileNotFoundError:
        raise LmcliError(f"{path.parent} is missing {path.name}") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LmcliError(f"cannot read weights {path}: {str(exc).splitlines()[0][:200]}") from None
    return WeightsHeader(path, tensors, size)


def expected_weights(cfg: ModelConfig) -> tuple[dict[str, tuple[str, tuple[int, ...]]], int]:
    """The tensors a checkpoint of ``cfg`` holds, as on disk (name -> (dtype, shape)), and the
    bytes the model computes from the config alone: its position tables plus the attention
    mask of one full-context window. From a model built on the meta device (no allocation)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    dtypes = {v: k for k, v in DTYPES.items()}
    expected = {
        DISK_NAMES.get(k, k): (dtypes[v.dtype], tuple(v.shape))
        for k, v in clean_state_dict(model.state_dict()).items()
        if not (cfg.tie_embeddings and k == "lm_head.weight")
    }
    computed = sum(b.numel() * b.element_size() for b in model.buffers())
    mask, _ = model.attention_mask(cfg.block_size, None, None, torch.float32, torch.device("meta"))
    if mask is not None:
        computed += mask.numel() * mask.element_size()
    return expected, computed


def check_header(
    cfg: ModelConfig,
    header: WeightsHeader,
    *,
    where: str | None = None,
    stored_dtypes: bool = False,
    stored_bytes: int | None = None,
) -> None:
    """One line when ``cfg`` does not describe the weights in ``header``, found before anything
    as large as the config claims is built: layers and embedding first (the numbers a crafted
    config inflates), then every tensor's name, shape and dtype, the total size, and the size
    of what the model computes from the config alone (position tables, masks).
    ``stored_dtypes``: any floating-point dtype is fine (an imported model's, converted when
    loaded), else the dtype lmcli saves; ``stored_bytes``: the tensors' bytes in the file when the
    dtypes do not tell (quantized GGUF blocks). ``where``: how messages name the weights."""
    where = where or f"weights {header.path}"
    layers = {int(m.group(1)) for name in header.tensors if (m := _LAYER.match(name))}
    if cfg.n_layer != len(layers) or layers != set(range(len(layers))):
        raise LmcliError(
            f"{where} do not fit the model config "
            f"(n-layer {cfg.n_layer}, layers in the weights: {len(layers)})"
        )
    wte = header.tensors.get("wte.weight")
    if wte is None or wte[1] != (cfg.padded_vocab_size, cfg.n_embd):
        got = "no wte.weight" if wte is None else f"wte.weight of shape {wte[1]}"
        rows = f"vocabulary {cfg.vocab_size}"
        if cfg.padded_vocab_size != cfg.vocab_size:
            rows += f" padded to {cfg.padded_vocab_size} rows (vocab-multiple {cfg.vocab_multiple})"
        raise LmcliError(
            f"{where} do not fit the model config ({rows} x n-embd {cfg.n_embd}, the weights hold {got})"
        )
    expected, computed = expected_weights(cfg)
    check_names(expected, header.tensors, f"{where} do not fit the model config")
    for name, (dtype, shape) in expected.items():
        got_dtype, got_shape = header.tensors[name]
        if got_shape != shape:
            raise LmcliError(f"{where}: {name} has shape {got_shape}, config expects {shape}")
        fits = got_dtype in DTYPES if stored_dtypes else got_dtype == dtype
        if not fits:
            wanted = f"one of {', '.join(DTYPES)}" if stored_dtypes else dtype
            raise LmcliError(f"{where}: {name} is {got_dtype}, expected {wanted}")
    stored = header.tensors if stored_dtypes else expected
    n_bytes = stored_bytes or sum(math.prod(s) * DTYPES[d].itemsize for d, s in stored.values())
    if n_bytes > header.file_size:
        raise LmcliError(f"{where}: {n_bytes} bytes of tensors in a file of {header.file_size} bytes")
    if computed > max(n_bytes, COMPUTED_FLOOR):
        raise LmcliError(
            f"{where}: the model config's block-size {cfg.block_size} needs {computed:,} bytes of "
            f"position tables and masks, more than the weights' {n_bytes:,}"
        )


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str = "") -> Transformer:
    """A model of ``cfg`` whose parameters *are* the tensors of ``state`` (names as on disk):
    built on the meta device, so nothing is drawn at random and nothing is copied; the position
    tables are then computed on the state's device."""
    with torch.device("meta"):
        model = Transformer(cfg)
    load_state(model, state, where, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight  # assign made two parameters of one tensor
    with torch.device("cpu"):  # where a freshly built model computes them, for the same values
        model.positions.make_tables(cfg)
    model.positions.to(model.wte.weight.device)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a tensor the format does not store and nothing computed: a bug, not bad input
        raise RuntimeError(f"not materialized after loading: {', '.join(left[:3])}")
    return model


def with_context(model: Transformer, block_size: int) -> Transformer:
    """``model`` with a context of ``block_size`` tokens (shorter than its own): the same weights,
    learned positions cut to their first ``block_size`` rows, the position tables made anew."""
    cfg = dataclasses.replace(model.config, block_size=block_size)
    state = model_state(model)
    if "wpe.weight" in state:
        state["wpe.weight"] = state["wpe.weight"][:block_size]
    return model_from_state(cfg, state).train(model.training)


def load_weights(cfg: ModelConfig, path: Path, device: torch.device | str = "cpu") -> Transformer:
    """The model of ``cfg`` with the weights in ``path``: the header is checked against the
    config before anything is built, then the tensors are read once and become the model's."""
    check_header(cfg, read_header(checked_file(path)))
    try:
        state = read_tensors(path) if str(device) == "cpu" else load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LmcliError(f"cannot read weights {path}: {str(exc).splitlines()[0][:200]}") from None
    return model_from_state(cfg, clean_state_dict(state))


_READ_DTYPES = {
    **DTYPES,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_tensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (its header already checked by ``safe_open``), read
    into memory of its own rather than memory-mapped; floating-point ones in ``dtype`` (None: as
    stored), converted one at a time.

    Why not ``load_file``: its tensors share one mapping of the file, whose pages, once read,
    stay resident (and counted in the process's memory) until the last tensor is freed. A model
    whose weights are then packed, laid out or converted for inference (``lmcli.fastpath``,
    ``lmcli.quant``) would hold them twice: the copies, and the mapped file behind the one
    weight (the tied embedding) still using it.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        base = 8 + size
        if any(v["dtype"] not in _READ_DTYPES for k, v in header.items() if k != "__metadata__"):
            return {k: _as_dtype(v, dtype) for k, v in load_file(str(path)).items()}
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_READ_DTYPES[info["dtype"]])
            f.seek(base + start)
            if t.numel() and f.readinto(t.reshape(-1).view(torch.uint8).numpy()) != end - start:
                raise ValueError(f"{name} is cut short")
            out[name] = _as_dtype(t, dtype)
    return out


def _as_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def load_state(
    model: Transformer, state: dict[str, torch.Tensor], where: str, *, assign: bool = False
) -> None:
    """Load weights named as on disk into ``model``; one line naming what does not fit.
    ``assign``: the tensors become the parameters (for a model built on the meta device)."""
    state = {MODULE_NAMES.get(k, k): v for k, v in state.items()}
    if model.config.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("wte.weight"))
    expected = model.state_dict()
    check_names(expected, state, f"weights {where} do not fit the model config")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise LmcliError(
                f"weights {where}: {key} has shape {tuple(value.shape)}, "
                f"config expects {tuple(expected[key].shape)}"
            )
    model.load_state_dict(state, assign=assign)


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
