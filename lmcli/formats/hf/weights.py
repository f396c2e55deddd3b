"""Reading a Hugging Face folder's weights and building our Transformer around them.

A folder is input someone else made, so its weights are checked before anything is built, as a
run folder's are (``checkpoint.check_header``): ``weight_files`` lists ``model.safetensors`` or
the shards ``model.safetensors.index.json`` names (each a regular file inside the folder, or in
the Hugging Face cache's ``blobs/`` beside a snapshot folder); ``read_headers`` reads their
headers alone (names, dtypes, shapes); ``check_weights`` maps them to lmcli's names on the meta
device and compares them with the config: layers and embedding first, then every tensor, and
what the config alone would make the model compute (position tables) against the weights' size.

``read_weights`` then opens the files with ``safetensors``' memory map: a tensor kept in its
stored dtype is a (private, copy-on-write) view of the file, so nothing is read twice and nothing
is copied; a tensor converted to another dtype is copied once. ``build_model`` makes the model on
the meta device and assigns those tensors to it, so no random weights are ever allocated.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError, check_blocks
from lmcli.formats.families import FamilyAdapter
from lmcli.formats.weights import (
    DTYPES,
    WeightsHeader,
    check_header,
    model_from_state,
    read_header,
    read_tensors,
)
from lmcli.model.skeleton import shapes_only
from lmcli.model.transformer import Transformer

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
INDEX_LIMIT = 64 << 20  # an index is a few hundred KiB
LAYER = re.compile(r"(?:^|\.)(\d+)\.")  # the block number of a per-block tensor's name


def shard_path(folder: Path, name: object) -> Path:
    """The file ``name`` (from an index) inside ``folder``: a relative path without ``..``,
    resolving inside the folder (or, for a Hugging Face cache snapshot, its ``blobs/``), and a
    regular file; one line otherwise (``/etc/passwd`` and ``../../x`` are never opened)."""
    where = f"{folder / INDEX}"
    if not isinstance(name, str) or not name:
        raise LmcliError(f"{where}: a shard name must be text, got {name!r}")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or "\\" in name or ".." in parts:
        raise LmcliError(f"{where}: shard {name!r} is outside the folder: shards must be inside it")
    path = folder / name
    if not os.path.lexists(path):
        raise LmcliError(f"{folder} is missing shard {name} (listed in {INDEX})")
    return regular_weights(folder, path)


def regular_weights(folder: Path, path: Path) -> Path:
    """``path`` if it is a regular file resolving inside ``folder`` (or a cache's ``blobs/``)."""
    real, home = path.resolve(), folder.resolve()
    blobs = home.parent.parent / "blobs" if home.parent.name == "snapshots" else None
    if not real.is_relative_to(home) and not (blobs is not None and real.is_relative_to(blobs)):
        raise LmcliError(f"{path} leads outside {folder}: weights must be inside the folder")
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise LmcliError(f"cannot read weights {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise LmcliError(f"{path} is not a regular file")
    return path


def _index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a folder's index: tensor name -> shard file name."""
    index = path / INDEX
    try:
        if regular_weights(path, index).stat().st_size > INDEX_LIMIT:
            raise LmcliError(f"cannot read {index}: larger than {INDEX_LIMIT >> 20} MiB")
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise LmcliError(f"cannot read {index}: {str(exc)[:200]}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise LmcliError(
            f"{index}: weight_map must be a table of tensor names to files, got {weight_map!r:.60}"
        )
    return weight_map


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a folder: one, or the shards its index names (each must exist)."""
    if os.path.lexists(path / SINGLE):
        return [regular_weights(path, path / SINGLE)]
    if os.path.lexists(path / INDEX):
        shards = sorted(set(_index(path).values()), key=str)
        return [shard_path(path, s) for s in shards]
    raise LmcliError(f"{path} has no {SINGLE} (or {INDEX})")


def is_pytorch_bin(path: Path) -> bool:
    """Whether the folder's weights are a ``pytorch_model.bin`` only (no safetensors)."""
    return not os.path.lexists(path / SINGLE) and not os.path.lexists(path / INDEX) and (path / BIN).exists()


def read_headers(path: Path) -> WeightsHeader:
    """The tensors (names, dtypes, shapes) of every weight file of the folder, from the headers
    alone (a ``pytorch_model.bin`` is memory-mapped: its tensors are not read); the size is the
    files' total."""
    if is_pytorch_bin(path):
        state = _read_bin(path)
        tensors = {k: (_DTYPE_NAMES.get(v.dtype, str(v.dtype)), tuple(v.shape)) for k, v in state.items()}
        return WeightsHeader(path / BIN, tensors, (path / BIN).stat().st_size)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    size = 0
    for file in weight_files(path):
        header = read_header(file)
        twice = sorted(set(header.tensors) & set(tensors))
        if twice:
            raise LmcliError(f"weights in {path}: {twice[0]} is in more than one file")
        tensors.update(header.tensors)
        size += header.file_size
    return WeightsHeader(path, tensors, size)


_TORCH_DTYPES = {
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
_TORCH_DTYPES.update({"BOOL": torch.bool, **DTYPES})
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def check_weights(family: FamilyAdapter, cfg: ModelConfig, header: WeightsHeader, folder: Path) -> None:
    """One line when the weights in ``header`` (Hugging Face names) do not fit ``cfg``, found
    before anything as large as the config claims is built: the number of blocks first (from
    the names), then every tensor under lmcli's name (``checkpoint.check_header``: the
    embedding, names, shapes, floating-point dtypes, size, and the position tables the config
    alone would make)."""
    where = f"weights in {folder}"
    labels = ("layers in config.json:", "blocks in the weights")
    check_blocks(header.tensors, LAYER, cfg.n_layer, f"{where} do not fit the model config", labels)
    meta = {}
    for name, (dtype, shape) in header.tensors.items():
        kind = _TORCH_DTYPES.get(dtype)
        if kind is None:
            raise LmcliError(f"{where}: {name} has a dtype lmcli does not read ({dtype})")
        meta[name] = torch.empty(shape, dtype=kind, device="meta")
    try:
        with shapes_only():
            ours = family.from_hf(meta, cfg)  # split/joined on the meta device: shapes only
    except RuntimeError as exc:
        raise LmcliError(f"{where} do not fit the model config ({str(exc).splitlines()[0][:200]})") from None
    if cfg.tie_embeddings:
        ours.pop("lm_head.weight", None)  # some tied checkpoints store the head too
    mapped = {k: (_DTYPE_NAMES.get(v.dtype, str(v.dtype)), tuple(v.shape)) for k, v in ours.items()}
    check_header(cfg, WeightsHeader(header.path, mapped, header.file_size), where=where, stored_dtypes=True)


def _read_bin(path: Path, mmap: bool = True) -> dict[str, Tensor]:
    """The tensors of the folder's ``pytorch_model.bin``: memory-mapped (``mmap``: for their
    names and shapes alone), else read into memory of the process's own (for the weights: a map's
    pages are the file's, so a file truncated under a running command kills it with SIGBUS)."""
    try:
        return torch.load(regular_weights(path, path / BIN), map_location="cpu", weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise LmcliError(f"cannot read weights {path / BIN}: {str(exc).splitlines()[0][:200]}") from None


def read_weights(path: Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Every tensor of the folder by its Hugging Face name, on the CPU; floating-point ones in
    ``dtype`` (None: as stored)."""
    if is_pytorch_bin(path):
        return {k: as_dtype(v, dtype) for k, v in _read_bin(path, mmap=False).items()}
    out: dict[str, Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt"):  # checks the header and its offsets
                pass
            out.update(read_tensors(file, dtype))  # not memory-mapped (see read_tensors)
        except (SafetensorError, OSError, ValueError) as exc:
            raise LmcliError(f"cannot read weights {file}: {str(exc).splitlines()[0][:200]}") from None
    return out


def as_dtype(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` in ``dtype`` if it is floating-point (None: as it is)."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def build_model(cfg: ModelConfig, state: dict[str, Tensor], where: str) -> Transformer:
    """A Transformer of ``cfg`` holding ``state`` (our names, as on disk), its tensors assigned,
    not copied. One line naming what does not fit when ``state`` does not match ``cfg``."""
    return model_from_state(cfg, state, where).eval()
