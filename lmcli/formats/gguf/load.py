"""A GGUF file in: its header checked, its tensors dequantized, its tokenizer rebuilt.

``read_gguf_header`` is the one check before anything is built, as a run folder's safetensors
header is checked against its config:

- ``gguf.check.check_gguf`` scans the header with bounds, reads the config through the family
  adapter (``config_from_gguf``, each value by the rule of the ``config.json`` field it stands
  for) and checks every tensor's name and shape, under lmcli's names, against it;
- the metadata and the tensor table are those of that bounded scan: of the metadata arrays only
  the tokenizer's (``ARRAYS``) are decoded, any other is skipped unread (``gguf.GGUFReader``
  would build Python objects for every element: a 2 MB file with a million-element array took
  a GB); each tensor's data is read at its checked offset into memory of the process's own
  (``read_data``: never a map of the file, which a truncation or a rewrite under a running
  command would change); a tensor type lmcli does not read (``TYPES``) is one line, a type no
  kernel runs as stored (``DEQUANTIZED``) one notice (``GgufHeader.notices``, printed as the
  model loads);
- the tokenizer is rebuilt from the metadata (``vocab.tokenizer_from_gguf``) and must fit
  the vocabulary; it is built before the tensors are read, and the arrays it is built from are
  not kept (``GgufHeader.meta`` holds the scalars and texts), so the Python objects of a large
  vocabulary never sit beside the weights.

``load_gguf`` then converts each tensor (``GgufTensor.dequantized``: F32, F16 and BF16 values
are views of the bytes read until converted; the quantized types go through ``gguf``'s
own ``quants.dequantize``), maps the names with the adapter and assigns the tensors to a model
built on the meta device. The weights' dtype is the caller's, or the embedding's as stored
(F32, F16, BF16), float32 for a quantized embedding.

Kept quantized (the seam for ``--quantize``): ``GgufHeader.tensors`` holds every tensor as the
file stores it; ``GgufTensor.rows()`` gives a quantized matrix's blocks as one row of bytes per
output row. The adapter's map only moves and concatenates whole rows (the rotary permutation of
``llama``'s query and key rows included), so ``gguf_state`` with a ``convert`` that returns the
rows of Q8_0/Q4_0 matrices yields them under lmcli's names, in lmcli's row order, for a
quantized linear layer to take instead of a dequantized weight.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.device import release_freed_memory
from lmcli.errors import LmcliError
from lmcli.formats.families import FamilyAdapter, HFConfig
from lmcli.formats.families.gguf_schema import GgufSchema
from lmcli.formats.gguf.check import GgufHeader as Scanned
from lmcli.formats.gguf.check import TensorInfo, check_gguf, stamp
from lmcli.formats.gguf.vocab import tokenizer_from_gguf
from lmcli.formats.weights import model_from_state
from lmcli.model.native import ops
from lmcli.model.transformer import Transformer
from lmcli.safe_io import open_input
from lmcli.text.tokenizer import Tokenizer

MAGIC = b"GGUF"
# the rarer block types: read as their values (gguf's quants.dequantize), no kernel runs them as stored
DEQUANTIZED = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "NVFP4")
# the tensor types lmcli reads, GGML's names: floats, the block formats the native kernels run as
# stored (ops.FORMATS; dequantized with gguf's quants where they do not run), the rarer ones
TYPES = ("F32", "F16", "BF16", *(fmt.upper() for fmt in ops.FORMATS), *DEQUANTIZED)
# the metadata arrays lmcli reads (the tokenizer's); any other array is skipped unread
ARRAYS = (
    *("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"),
    "tokenizer.ggml.scores",  # a SentencePiece vocabulary's
)
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def is_gguf_file(path: str | Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not os.path.lexists(path) or path.is_dir():
        return False
    with open_input(path) as f:  # a FIFO or a device named as a model is one line, not a hang
        return f.read(4) == MAGIC


@dataclass
class GgufTensor:
    """One tensor as the file stores it (its bytes read, see ``read_data``)."""

    name: str
    kind: str  # GGML's type name: F32, F16, BF16, Q8_0, ...
    shape: tuple[int, ...]  # PyTorch's order: a linear layer's (out, in)
    data: np.ndarray  # float values (F32, F16), else bytes: (rows, bytes per row)

    @property
    def quantized(self) -> bool:
        return self.kind not in _FLOATS

    def rows(self) -> Tensor:
        """The stored bytes, one row of bytes per row of the matrix (uint8, a view of those read)."""
        return torch.from_numpy(self.data.view(np.uint8).reshape(self.shape[0], -1))

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """The values in ``dtype`` (None: F32/F16/BF16 as stored, quantized types as float32)."""
        if self.kind == "BF16":
            out = self.rows().view(torch.bfloat16).reshape(self.shape)
        elif self.kind in _FLOATS:
            out = torch.from_numpy(self.data).reshape(self.shape)
        else:
            import gguf

            values = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.kind])
            out = torch.from_numpy(values).reshape(self.shape)
        return out.to(dtype) if dtype is not None and out.dtype != dtype else out


@dataclass
class GgufHeader:
    """A GGUF file after ``read_gguf_header``: every check passed, nothing built."""

    path: Path
    meta: HFConfig  # the scalar and text metadata, keys as the file names them (the arrays: ``tokenizer``)
    tensors: dict[str, GgufTensor]  # by GGUF name
    family: FamilyAdapter
    config: ModelConfig
    tokenizer: Tokenizer
    table: dict[str, TensorInfo]  # the bounded scan's: GGML type, shape, offset in the file, bytes
    notices: list[str]  # what the metadata leaves out or contradicts, what loading does (a line each)

    @property
    def name(self) -> str:
        """``general.name``, else the file's name without ``.gguf``."""
        name = self.meta.get("general.name")
        return name if isinstance(name, str) and name.strip() else self.path.stem


def _metadata(scanned: Scanned) -> HFConfig:
    """The file's scalar and text metadata, and decoded the arrays lmcli reads (``ARRAYS``): the
    others (a crafted million-element array) are skipped, never materialized."""
    out: dict[str, Any] = dict(scanned.metadata)
    for key in ARRAYS:
        if key in scanned.arrays:
            value = scanned.array(key)
            out[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return HFConfig(out, str(scanned.path), GgufSchema())


def _tensors(scanned: Scanned) -> dict[str, GgufTensor]:
    """The tensor table of the bounded scan, each tensor's data read into memory of its own (see
    ``read_data``); one line naming a type lmcli does not read."""
    where = str(scanned.path)
    for t in scanned.tensors.values():
        if t.type_name not in TYPES:
            reads = ", ".join(TYPES)
            raise LmcliError(
                f"{where}: tensor {t.name} is {t.type_name}, a type lmcli does not read (it reads {reads})"
            )
    out = {}
    for name, raw in read_data(scanned).items():
        info = scanned.tensors[name]
        if info.type_name in ("F32", "F16"):
            data = raw.view(np.float32 if info.type_name == "F32" else np.float16).reshape(info.shape)
        else:  # BF16 and quantized blocks: one row of bytes per row
            data = raw.reshape(*info.shape[:-1], -1)
        out[name] = GgufTensor(name, info.type_name, info.shape, data)
    return out


def read_data(scanned: Scanned) -> dict[str, np.ndarray]:
    """Each tensor's bytes, read from the scanned file into memory of the process's own (uint8,
    one array a tensor, in the order of the file); one line when the file is no longer the one
    scanned (its ``stamp`` changed) or changes while it is read.

    Not memory-mapped: the bytes of a map are the file's, so a file truncated under a running
    command killed it with SIGBUS at the next read of a page past the new end, and a file
    rewritten in place changed the weights it was computing with. Read, they are the process's:
    the file may then be truncated, rewritten or replaced without effect. The memory is what a
    map whose pages were all read would hold, and a tensor converted on load (dequantized,
    reordered) frees its bytes.
    """
    where = str(scanned.path)
    changed = LmcliError(f"{where} changed while it was read (read it again when it is complete)")
    out: dict[str, np.ndarray] = {}
    try:
        with open_input(scanned.path, "GGUF file") as f:
            if stamp(os.fstat(f.fileno())) != scanned.stamp:
                raise changed
            for info in sorted(scanned.tensors.values(), key=lambda t: t.offset):
                raw = np.empty(info.n_bytes, dtype=np.uint8)
                f.seek(info.offset)
                if f.readinto(raw) != info.n_bytes:
                    raise changed
                out[info.name] = raw
            if stamp(os.fstat(f.fileno())) != scanned.stamp:
                raise changed
    except OSError as exc:
        raise LmcliError(f"cannot read GGUF file {where}: {exc.strerror or exc}") from None
    return out


def read_gguf_header(path: str | Path) -> GgufHeader:
    """A GGUF file's metadata, tensor table, config and tokenizer, every one checked (see the
    module doc) before anything is built; one line naming the first problem."""
    path = Path(path)
    if not os.path.lexists(path):
        raise LmcliError(f"no such GGUF file: {path}")
    # the header scanned with bounds, its config read and every tensor's shape checked against
    # it first: gguf's reader trusts the file's counts
    scanned, family, cfg, notices = check_gguf(path)
    where = str(path)
    # the tokenizer first, from the arrays decoded for it alone: its texts, scores and merges
    # (a 262k vocabulary's: 200 MB of Python objects) are gone before the weights are read
    tok = tokenizer_from_gguf(_metadata(scanned))
    if tok.vocab_size > cfg.vocab_size:
        raise LmcliError(f"{where}: its tokenizer has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    meta = HFConfig(dict(scanned.metadata), where, GgufSchema())  # scalars and text
    scanned.raw = b""  # the header's bytes: every array lmcli reads is decoded
    release_freed_memory()
    tensors = _tensors(scanned)
    return GgufHeader(
        path, meta, tensors, family, cfg, tok, scanned.tensors, [*notices, *_dequantized(tensors)]
    )


def _dequantized(tensors: dict[str, GgufTensor]) -> list[str]:
    """One notice naming the rarer types the file holds (``DEQUANTIZED``), or none."""
    kinds = sorted({t.kind for t in tensors.values() if t.kind in DEQUANTIZED})
    if not kinds:
        return []
    count = sum(t.kind in DEQUANTIZED for t in tensors.values())
    read = "are read as their dequantized values (no kernel runs them as stored)"
    return [f"its {', '.join(kinds)} tensors ({count}) {read}"]


def tell(header: GgufHeader) -> None:
    """The header's notices on stderr, one line each (``note: FILE: ...``)."""
    for notice in header.notices:
        print(f"note: {header.path}: {notice}", file=sys.stderr)


def gguf_state(
    header: GgufHeader, convert: Callable[[GgufTensor], Tensor] | None = None
) -> dict[str, Tensor]:
    """Every tensor converted (``convert``; default: dequantized as stored) under lmcli's names."""
    convert = convert or (lambda t: t.dequantized())
    state = {name: convert(t) for name, t in header.tensors.items()}
    return header.family.from_gguf(state, header.config)


def default_dtype(header: GgufHeader) -> torch.dtype:
    """The embedding's dtype as stored (F32, F16, BF16), float32 for a quantized one."""
    return _FLOATS.get(header.tensors["token_embd.weight"].kind, torch.float32)


def load_gguf(
    path: str | Path, dtype: torch.dtype | None = None
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """A GGUF file as our Transformer (eval mode, weights in ``dtype``; None: ``default_dtype``),
    its Tokenizer and what it says of itself (``source``, ``name``, tensor types)."""
    header = read_gguf_header(path)
    tell(header)
    dtype = dtype or default_dtype(header)
    # vectors (norms, biases) as stored until the adapter's map is done: Gemma 3's norm weights
    # are stored with 1 added, which comes off in float32 before the weights' dtype rounds them
    state = gguf_state(header, lambda t: t.dequantized(dtype if len(t.shape) > 1 else None))
    state = {name: t.to(dtype) for name, t in state.items()}
    model = model_from_state(header.config, state, f"in {header.path}").eval()
    return model, header.tokenizer, gguf_meta(header)


def gguf_meta(header: GgufHeader) -> dict[str, Any]:
    """What a GGUF file says of itself: ``source``, ``name``, ``architecture``, tensor ``types``."""
    kinds = sorted({t.kind for t in header.tensors.values()})
    return {"source": "gguf", "name": header.name, "architecture": header.family.gguf_arch, "types": kinds}
