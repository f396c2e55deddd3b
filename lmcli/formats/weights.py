"""Model weights in safetensors: headers read and checked against a config before anything
is allocated, tensors read without copies, a model built around them, and the names on disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError, check_blocks, check_names, check_tensors
from lmcli.model.skeleton import skeleton
from lmcli.model.transformer import Transformer
from lmcli.safe_io import checked_file

_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers


# parameters whose name in a checkpoint file differs from the module path (lmcli 0.1's names)
DISK_NAMES = {"positions.wpe.weight": "wpe.weight"}


MODULE_NAMES = {disk: module for module, disk in DISK_NAMES.items()}


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


# safetensors dtype names of the floating-point tensors lmcli reads (a model is built in float32)
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


# what a model computes from its config alone (position tables, a full-context attention bias)
# may take the weights' size, or this much for small models with long contexts
COMPUTED_FLOOR = 256 << 20


_LAYER = re.compile(r"^h\.(\d+)\.")


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
    model = skeleton(cfg)
    dtypes = {v: k for k, v in DTYPES.items()}
    expected = {
        DISK_NAMES.get(k, k): (dtypes[v.dtype], tuple(v.shape))
        for k, v in clean_state_dict(model.state_dict()).items()
        if not (cfg.tie_embeddings and k == "lm_head.weight")
    }
    # the position tables as a forward over the whole context grows them (4 bytes a value)
    shapes = model.positions.table_shapes(cfg, cfg.block_size).values()
    computed = sum(4 * math.prod(shape) for shape in shapes)
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
    labels = ("n-layer", "layers in the weights")
    check_blocks(header.tensors, _LAYER, cfg.n_layer, f"{where} do not fit the model config", labels)
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
    floats = tuple(DTYPES) if stored_dtypes else ()  # any float an import converts, or lmcli's own
    check_tensors(expected, header.tensors, where, "the model config", "config expects", floats)
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
    model = skeleton(cfg)
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


def read_tensors(
    path: Path, dtype: torch.dtype | None = None, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (its header already checked by ``safe_open``), or those
    ``names`` names, read into memory of its own rather than memory-mapped; floating-point ones
    in ``dtype`` (None: as stored), converted one at a time.

    Why not ``load_file``: its tensors share one mapping of the file, whose pages, once read,
    stay resident (and counted in the process's memory) until the last tensor is freed. A model
    whose weights are then packed, laid out or converted for inference (``lmcli.model.fastpath``,
    ``lmcli.model.quant``) would hold them twice: the copies, and the mapped file behind the one
    weight (the tied embedding) still using it.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        base = 8 + size
        if any(v["dtype"] not in _READ_DTYPES for k, v in header.items() if k != "__metadata__"):
            every = load_file(str(path))
            return {k: _as_dtype(v, dtype) for k, v in every.items() if names is None or k in names}
        out = {}
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
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
