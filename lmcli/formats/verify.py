"""`lmcli verify`: a model's files checked as loading checks them, without building a model.

- A run or checkpoint folder, for every checkpoint (``last``, ``best``, ``step-N``, an
  interrupted swap's ``*.old``): no symbolic links, the files present and regular,
  ``meta.json`` records a sha256 for each and each matches, ``config.json`` holds valid
  configs, the safetensors header fits the model config (names, shapes, dtypes, sizes;
  ``lmcli.formats.weights.check_header``), the tokenizer loads and fits the vocabulary, and
  ``trainer_state.pt`` loads with ``weights_only`` (no code runs), and every weight is finite
  (read a chunk at a time, as for a GGUF file). A LoRA run's checkpoint:
  its base found unchanged, its weights' header against its config, and the adapters' header
  against the run's LoRA settings on that base (``lora.check_adapters``: the rank, every
  adapter's shape).
- A Hugging Face folder: ``config.json`` (every value, ``HFConfig``), the tokenizer, every
  shard's header against the config (``lmcli.formats.hf.weights.check_weights``), and every
  safetensors weight finite.
- A GGUF file: its header scanned with bounds and its tensors against its metadata
  (``lmcli.formats.gguf.check.check_gguf``), then read as loading reads it: its tokenizer rebuilt
  and checked against the vocabulary (``lmcli.formats.gguf.load.read_gguf_header``), and every
  value of every tensor finite (a float tensor read a chunk at a time; a quantized one by its
  scales).

The first problem is an ``LmcliError`` naming it. What it cannot tell: whether the weights are
the ones that were trained (a checksum recomputed by whoever edited a file matches again), and
what a chat template does when it runs (rendering is bounded when it happens).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from lmcli.config.files import from_dict, stored_model_config
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    ADAPTERS,
    BASE,
    CONFIG,
    META,
    STATE,
    TOKENIZER,
    WEIGHTS,
    read_json,
    verify_checksums,
)
from lmcli.formats.gguf.load import GgufTensor, read_gguf_header
from lmcli.formats.hf.load import is_hf_folder, read_hf_config, read_tokenizer
from lmcli.formats.hf.weights import check_weights, is_pytorch_bin, read_headers, weight_files
from lmcli.formats.lora_base import checked_base
from lmcli.formats.model_source import ModelSource
from lmcli.formats.weights import DTYPES, WeightsHeader, check_header, read_header
from lmcli.model.lora import check_adapters
from lmcli.model.skeleton import skeleton
from lmcli.safe_io import checked_file, refuse_symlinks
from lmcli.text.tokenizer import Tokenizer

REQUIRED = (WEIGHTS, CONFIG, TOKENIZER)
CHUNK_VALUES = 1 << 22  # values (or quantized blocks) of a GGUF tensor read at a time by the NaN scan
# GGML's quantized blocks: (bytes, where its float16 scales are), as ggml-common.h lays them out
# where each block holds its half-precision scales (byte offsets; a block's size is the gguf
# package's, GGML_QUANT_SIZES): these alone can make a block's values NaN or infinite
BLOCK_SCALES = {
    "Q8_0": (0,),  # d, 32 int8
    "Q4_0": (0,),  # d, 16 bytes of 4-bit values
    "Q4_1": (0, 2),  # d, m, 16 bytes
    "Q5_0": (0,),  # d, 4 bytes of fifth bits, 16 bytes
    "Q5_1": (0, 2),  # d, m, 4 bytes, 16 bytes
    "Q2_K": (80, 82),  # 16 bytes of 4-bit scales and mins, 64 bytes of 2-bit values, then d, dmin
    "Q3_K": (108,),  # 32 bytes high bits, 64 low bits, 12 bytes of scales, then d
    "Q4_K": (0, 2),  # d, dmin, 12 bytes of 6-bit scales, 128 bytes of 4-bit values
    "Q5_K": (0, 2),  # d, dmin, 12 bytes of scales, 32 of high bits, 128 of low bits
    "Q6_K": (208,),  # 128 bytes low bits, 64 high bits, 16 int8 scales, then d
    "IQ4_NL": (0,),  # d, 16 bytes of 4-bit indices
    "IQ4_XS": (0,),  # d, 2 + 4 bytes of 6-bit scales, 128 bytes of indices
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes scanned for NaN
REQUIRED_LORA = (ADAPTERS, BASE, CONFIG, TOKENIZER)  # a LoRA run's checkpoint: adapters and a base


@dataclass
class CheckpointReport:
    """What verifying one checkpoint folder (or model file) found (it passed)."""

    path: Path
    step: int | None
    params: int
    files: int  # files whose checksum matched
    what: str = ""  # what was checked, when not an lmcli checkpoint's checksums
    notes: tuple[str, ...] = ()  # what loading reads past (a GGUF file's metadata that disagrees)

    def line(self) -> str:
        if self.what:
            notes = "".join(f"\n    note: {n}" for n in self.notes)
            return f"ok  {self.path}: {self.what}, {self.params:,} parameters{notes}"
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
    model_config, train_config = read_configs(ckpt / CONFIG)
    if lora:
        header = read_header(ckpt / ADAPTERS)
        base = checked_base(ckpt, read_json(ckpt / BASE, "LoRA base reference"))
        check_lora(ckpt, base, model_config, train_config, header)
    else:
        header = read_header(ckpt / WEIGHTS)
        check_header(model_config, header)
    refuse_nonfinite(ckpt, nonfinite_safetensors([ckpt / (ADAPTERS if lora else WEIGHTS)]))
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


def read_configs(path: Path) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configs of a ``config.json``."""
    cfg = read_json(path, "config")
    if not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("train", {}), dict):
        raise LmcliError(f"{path} has no model config")
    train = from_dict(TrainConfig, cfg.get("train", {}), source=str(path))
    return stored_model_config(cfg["model"], source=str(path)), train


def base_config(base: ModelSource) -> ModelConfig:
    """The model config of a LoRA run's base, its weights' header checked against it (a GGUF
    file's tensors are checked against its metadata as its header is read)."""
    if base.kind == "hf":
        _, family, cfg, _ = read_hf_config(base.path)
        check_weights(family, cfg, read_headers(base.path), base.path)
        return cfg
    if base.kind == "gguf":
        return read_gguf_header(base.path).config
    cfg, _ = read_configs(base.folder / CONFIG)
    check_header(cfg, read_header(checked_file(base.folder / WEIGHTS)))
    return cfg


def check_lora(
    ckpt: Path, base: ModelSource, model_config: ModelConfig, train_config: TrainConfig, header: WeightsHeader
) -> None:
    """A LoRA checkpoint's adapters against its LoRA settings on its base (shapes only)."""
    if base_config(base) != model_config:
        raise LmcliError(f"the base model {base.path} does not fit LoRA run {ckpt}'s model config")
    model = skeleton(model_config)
    check_adapters(model, train_config, header.tensors, str(ckpt / ADAPTERS))


def verify_hf(path: Path) -> CheckpointReport:
    """A Hugging Face folder: its config, tokenizer and every shard's header against the config."""
    hf, family, cfg, _ = read_hf_config(path)
    tok = read_tokenizer(path, hf)
    if tok.vocab_size > cfg.vocab_size:
        raise LmcliError(f"tokenizer in {path} has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    header = read_headers(path)
    check_weights(family, cfg, header, path)
    if not is_pytorch_bin(path):  # (a pytorch_model.bin is checked as far as its header goes)
        refuse_nonfinite(path, nonfinite_safetensors(weight_files(path)))
    what = f"Hugging Face {family.name} folder, weights fit config.json, tokenizer of {tok.vocab_size} tokens"
    return CheckpointReport(path, None, header.n_params, 0, what)


def nonfinite_tensor(tensors: dict[str, GgufTensor], chunk: int = CHUNK_VALUES) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None. A quantized block's
    values are its float16 scales times small integers: they are finite exactly when its scales
    are (``BLOCK_SCALES``), so only those are read; float tensors are read about ``chunk``
    values at a time (memory stays small however large the file)."""
    for name, t in tensors.items():
        if t.kind in BLOCK_SCALES:
            offsets, size = BLOCK_SCALES[t.kind], gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.kind]][1]
            blocks = t.data.view(np.uint8).reshape(-1, size)  # (blocks, bytes of a block)
            for i in range(0, len(blocks), chunk):
                part = blocks[i : i + chunk]
                if not all(np.isfinite(part[:, o : o + 2].copy().view(np.float16)).all() for o in offsets):
                    return name
            continue
        rows = t.data.reshape(t.shape[0], -1)  # (rows, values or bytes per row)
        step = max(1, chunk // max(1, math.prod(t.shape[1:])))
        for i in range(0, t.shape[0], step):
            part = GgufTensor(name, t.kind, (len(rows[i : i + step]), *t.shape[1:]), rows[i : i + step])
            if not torch.isfinite(part.dequantized()).all():
                return name
    return None


def nonfinite_safetensors(files: list[Path], chunk: int = CHUNK_VALUES) -> str | None:
    """The name of the first floating-point tensor of these safetensors files (their headers
    already checked) holding a NaN or an infinity, or None; read about ``chunk`` values at a
    time, so memory stays small however large the file. Read, not through a map of the file:
    a file truncated meanwhile is one line, never SIGBUS."""
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            for name, info in header.items():
                if name == "__metadata__" or info["dtype"] not in FLOAT_DTYPES:
                    continue
                shape, dtype = info["shape"], DTYPES[info["dtype"]]
                row = math.prod(shape[1:])  # values a row (a scalar: one row of one)
                rows = shape[0] if shape else 1
                step = max(1, chunk // max(1, row))
                f.seek(8 + size + info["data_offsets"][0])
                for i in range(0, rows, step):
                    part = torch.empty(min(step, rows - i) * row, dtype=dtype)
                    raw = part.view(torch.uint8).numpy()
                    if f.readinto(raw) != len(raw):
                        raise LmcliError(f"{file} changed while it was read")
                    if not torch.isfinite(part).all():
                        return name
    return None


def refuse_nonfinite(path: Path, bad: str | None) -> None:
    if bad is not None:
        raise LmcliError(f"{path} holds NaN or infinite weights ({bad}): the model would compute nothing")


def verify_gguf(path: Path) -> CheckpointReport:
    """A GGUF file: its header and its tensors against its metadata, and every value finite."""
    header = read_gguf_header(path)
    refuse_nonfinite(path, nonfinite_tensor(header.tensors))
    params = sum(math.prod(t.shape) for t in header.tensors.values())
    kinds = ", ".join(sorted({t.kind for t in header.tensors.values()}))
    vocab = header.tokenizer.vocab_size
    what = (
        f"GGUF {header.family.gguf_arch} file ({kinds}), tensors fit its metadata, "
        f"tokenizer of {vocab} tokens"
    )
    return CheckpointReport(path, None, params, 0, what, tuple(header.notices))


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


def verify_run(path: str | Path) -> list[CheckpointReport]:
    """Check a run folder (its ``config.json`` and every checkpoint), one checkpoint folder, a
    Hugging Face folder or a GGUF file."""
    path = Path(path)
    if not os.path.lexists(path):
        raise LmcliError(f"no such run or checkpoint folder: {path}")
    if path.is_file() and not path.is_symlink():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return [verify_gguf(path)]
    if not path.is_dir() or path.is_symlink():
        raise LmcliError(f"{path} is not a folder (nor a GGUF file)")
    if is_hf_folder(path):
        return [verify_hf(path)]
    refuse_symlinks(path)
    if os.path.lexists(path / CONFIG) and not os.path.lexists(path / META):  # a run's config
        read_configs(path / CONFIG)
    return [verify_checkpoint(ckpt) for ckpt in checkpoints_of(path)]
