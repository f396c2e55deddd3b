"""A GGUF file read as untrusted input: its header scanned with bounds, checked before anything
is built.

``gguf.GGUFReader`` makes several Python objects for every element of every metadata array
(about 800 bytes and 10 µs each: a 7 MB file holding a million-element array takes a GB and
12 s), and trusts the file's counts and offsets. ``scan`` reads the same header with bounds
instead: every count, length and offset must fit in the file, tensors have at most 4
dimensions of a known GGML type, and their data lies inside the file's data section, each at a
multiple of ``general.alignment`` (as llama.cpp requires), no two overlapping; at most
``ELEMENTS`` array elements in all; arrays are not decoded (``GgufHeader.array`` does it on
demand). Its cost is one ``struct`` read per string in an array, nothing per number.

The header's bytes are read (``GgufHeader.raw``), never memory-mapped: a file truncated while
it is mapped kills the process with SIGBUS at the next read of a page past the new end. What
the scan saw is stamped (``GgufHeader.stamp``: the file's device, inode, size and modification
time), so the reader of the tensors can tell that the file it reads is the one scanned.

``check_gguf`` is the header-before-build check of GGUF files, as ``checkpoint.check_header``
is of run folders: the family from ``general.architecture``, lmcli's ``ModelConfig`` from the
metadata (each value checked by the rule of the ``config.json`` field it stands for,
``HFConfig``), then every tensor, under lmcli's name (``FamilyAdapter.from_gguf`` on the meta
device), against that config: blocks, embedding, shapes, the data's size, and the position
tables the config alone would make. A GGUF import builds its model only after it passes.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError, check_blocks
from lmcli.formats.families import FamilyAdapter, HFConfig, from_gguf_arch
from lmcli.formats.families.gguf_schema import GgufSchema
from lmcli.formats.weights import WeightsHeader, check_header
from lmcli.model.skeleton import shapes_only
from lmcli.safe_io import open_input

MAGIC = b"GGUF"
VERSIONS = (2, 3)
ELEMENTS = 16 << 20  # array elements in all the metadata (a vocabulary and its merges: ~1M)
TENSORS = 1 << 16
TEXT_LIMIT = 16 << 20  # bytes of one metadata string (a chat template: a few KiB)
STRING, ARRAY = 8, 9
# value type -> struct format of the fixed-size ones (GGUF's GGUFValueType)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class TensorInfo:
    """One tensor of a GGUF file: its GGML type, its shape in PyTorch's order, where its data is."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    n_bytes: int


def stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one state of a file from another: device, inode, size, modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class GgufHeader:
    """What a GGUF file's header holds, checked (``scan``)."""

    path: Path
    version: int
    metadata: dict[str, Any]  # scalars and strings
    arrays: dict[str, tuple[int, int, int]]  # key -> (element type, count, offset of the first)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0
    file_size: int = 0
    raw: bytes | bytearray = b""  # the file's bytes from its start, at least to the end of the header
    stamp: tuple[int, int, int, int] = (0, 0, 0, 0)  # the file's ``stamp`` when it was scanned

    def array(self, key: str) -> list[str] | np.ndarray:
        """The array ``key`` decoded (from the bytes the scan read): a list of text, or a numpy
        array of numbers."""
        kind, count, offset = self.arrays[key]
        raw = self.raw
        if kind in SCALARS:
            return np.frombuffer(raw, dtype="<" + SCALARS[kind], count=count, offset=offset).copy()
        out = []
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", raw, offset)
            out.append(raw[offset + 8 : offset + 8 + n].decode("utf-8", errors="replace"))
            offset += 8 + n
        return out


class _Cursor:
    """Bounded reads from the start of a file: each one must fit in it (``size``); its bytes
    are read as the reads reach them, a MiB or more at a time, into ``raw``."""

    def __init__(self, f: IO[bytes], size: int, where: str) -> None:
        self.f, self.size, self.where = f, size, where
        self.raw, self.pos, self.elements = bytearray(), 0, 0

    def need(self, n: int, what: str) -> None:
        """Check that ``n`` bytes from here fit in the file (nothing read)."""
        if n < 0 or self.pos + n > self.size:
            raise LmcliError(f"{self.where}: {what} runs past the end of the file (truncated or damaged)")

    def take(self, n: int, what: str) -> int:
        """``n`` bytes from here read into ``raw`` (checked to fit); the position they start at."""
        self.need(n, what)
        end = self.pos + n
        if end > len(self.raw):
            more = max(end - len(self.raw), min(len(self.raw), 64 << 20), 1 << 20)
            self.raw += self.f.read(min(more, self.size - len(self.raw)))
            if end > len(self.raw):
                raise LmcliError(f"{self.where} changed while it was read")
        start, self.pos = self.pos, end
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize("<" + fmt), what)
        return struct.unpack_from("<" + fmt, self.raw, start)[0]

    def text(self, what: str, limit: int = TEXT_LIMIT) -> str:
        n = self.unpack("Q", what)
        if n > limit:
            raise LmcliError(f"{self.where}: {what} is {n:,} bytes long (at most {limit:,})")
        start = self.take(n, what)
        return self.raw[start : start + n].decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Any:
        if kind in SCALARS:
            return self.unpack(SCALARS[kind], key)
        if kind == STRING:
            return self.text(key)
        raise LmcliError(f"{self.where}: {key} has an unknown value type {kind}")

    def skip_array(self, key: str) -> tuple[int, int, int]:
        kind, count = self.unpack("I", key), self.unpack("Q", key)
        self.elements += count
        if self.elements > ELEMENTS:
            raise LmcliError(f"{self.where}: the metadata holds more than {ELEMENTS:,} array elements")
        start = self.pos
        if kind in SCALARS:
            self.take(count * struct.calcsize(SCALARS[kind]), key)
        elif kind == STRING:
            self.need(count * 8, key)  # every string has its 8-byte length at least
            for _ in range(count):
                self.take(self.unpack("Q", key), key)
        else:
            raise LmcliError(f"{self.where}: {key} is an array of type {kind}, which lmcli does not read")
        return kind, count, start


def scan(path: str | Path) -> GgufHeader:
    """The header of the GGUF file ``path``, every count, length and offset checked against the
    file (see the module docstring); one line naming the file and the problem."""
    import gguf

    path = Path(path)
    where = str(path)
    try:
        with open_input(path, "GGUF file") as f:
            st = os.fstat(f.fileno())
            cur = _Cursor(f, st.st_size, where)
            if st.st_size < 24 or cur.raw[cur.take(4, "the magic") : 4] != MAGIC:
                raise LmcliError(f"{where} is not a GGUF file (no GGUF magic)")
            version = cur.unpack("I", "the version")
            if version not in VERSIONS:
                raise LmcliError(f"{where}: GGUF version {version} (lmcli reads 2 and 3, little-endian)")
            n_tensors, n_kv = cur.unpack("Q", "the tensor count"), cur.unpack("Q", "the key count")
            if n_tensors > TENSORS or n_kv > st.st_size // 13:  # a key-value pair takes 13 bytes at least
                raise LmcliError(f"{where}: {n_tensors:,} tensors and {n_kv:,} metadata keys cannot be right")
            header = GgufHeader(path, version, {}, {}, file_size=st.st_size, stamp=stamp(st))
            for _ in range(n_kv):
                key = cur.text("a metadata key", 1 << 16)
                if key in header.metadata or key in header.arrays:
                    raise LmcliError(f"{where}: metadata key {key!r} appears twice")
                kind = cur.unpack("I", key)
                if kind == ARRAY:
                    header.arrays[key] = cur.skip_array(key)
                else:
                    header.metadata[key] = cur.value(kind, key)
            infos = [_tensor_info(cur, gguf) for _ in range(n_tensors)]
    except OSError as exc:
        raise LmcliError(f"cannot read {where}: {exc.strerror or exc}") from None
    del cur.raw[cur.pos :]  # the bytes read past the header's end (up to a MiB, or its size)
    header.raw = cur.raw
    align = header.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align < 1 or align & (align - 1) or align > 1 << 16:
        raise LmcliError(f"{where}: general.alignment {align!r} is not a power of two")
    header.data_offset = -(-cur.pos // align) * align
    _place(header, infos, align)
    return header


def _place(header: GgufHeader, infos: list[TensorInfo], align: int) -> None:
    """The tensors of ``infos`` into ``header``, their offsets from the start of the file; one
    line for a tensor named twice, one whose data is not at a multiple of ``align`` from the
    start of the data section (llama.cpp refuses it too), runs past the end of the file, or
    overlaps another's (a crafted file: one byte read as two tensors)."""
    where = str(header.path)
    for info in infos:
        if info.name in header.tensors:
            raise LmcliError(f"{where}: tensor {info.name} appears twice")
        if info.offset % align:
            raise LmcliError(
                f"{where}: the data of tensor {info.name} is at offset {info.offset:,} of the data "
                f"section, not a multiple of general.alignment ({align})"
            )
        info.offset += header.data_offset
        if info.offset + info.n_bytes > header.file_size:
            raise LmcliError(
                f"{where}: the data of tensor {info.name} runs past the end of the file "
                "(truncated or damaged)"
            )
        header.tensors[info.name] = info
    ordered = sorted(infos, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.n_bytes > b.offset:
            raise LmcliError(f"{where}: the data of tensors {a.name} and {b.name} overlap (a damaged file)")


def _tensor_info(cur: _Cursor, gguf: Any) -> TensorInfo:
    name = cur.text("a tensor name", 1 << 16)
    n_dims = cur.unpack("I", name)
    if not 1 <= n_dims <= 4:
        raise LmcliError(f"{cur.where}: tensor {name} has {n_dims} dimensions (1 to 4)")
    dims = [cur.unpack("Q", name) for _ in range(n_dims)]
    kind, offset = cur.unpack("I", name), cur.unpack("Q", name)
    if kind not in {t.value for t in gguf.GGMLQuantizationType}:
        raise LmcliError(f"{cur.where}: tensor {name} has an unknown GGML type {kind}")
    ggml = gguf.GGMLQuantizationType(kind)
    block, type_size = gguf.GGML_QUANT_SIZES[ggml]
    n = math.prod(dims)
    if not all(d >= 1 for d in dims) or n >= 1 << 48 or dims[0] % block:
        raise LmcliError(f"{cur.where}: tensor {name} has dimensions {dims} a {ggml.name} tensor cannot have")
    return TensorInfo(name, kind, ggml.name, tuple(reversed(dims)), offset, n * type_size // block)


# keys llama.cpp's converter writes for an architecture, read as another model when absent:
# llama.cpp reads such a file all the same (as lmcli does), so their absence is a notice
EXPECTED_KEYS = {
    "gemma3": (
        ("attention.sliding_window", "every layer attending to the whole context (Gemma 3's have a window)"),
    ),
}


def config_from_gguf(header: GgufHeader) -> tuple[FamilyAdapter, ModelConfig, list[str]]:
    """The family and lmcli's ModelConfig of a scanned GGUF file: its metadata read by the family
    adapter (``FamilyAdapter.config_from_gguf``), each value by the rule of the ``config.json``
    field it stands for (``HFConfig`` with ``GgufSchema``); and notices of what the file says
    otherwise than its tensors, or leaves out (``EXPECTED_KEYS``), that loading reads past."""
    where = str(header.path)
    meta = HFConfig(header.metadata, where, GgufSchema())
    family = from_gguf_arch(str(meta.require("general.architecture")), where)
    shapes = {name: t.shape for name, t in header.tensors.items()}
    cfg = family.config_from_gguf(meta, shapes)
    arch, notices = family.gguf_arch, []
    said = header.metadata.get(f"{arch}.vocab_size")
    if said is not None and said != cfg.vocab_size:  # llama.cpp sizes the vocabulary by its tokens
        notices.append(
            f"{arch}.vocab_size says {said!r} tokens, token_embd.weight has {cfg.vocab_size:,} rows: "
            "the rows are read (as llama.cpp does)"
        )
    for key, otherwise in EXPECTED_KEYS.get(arch, ()):
        if f"{arch}.{key}" not in header.metadata:
            notices.append(f"{arch}.{key} is missing: read as llama.cpp reads it, {otherwise}")
    return family, cfg, notices


def check_gguf(path: str | Path) -> tuple[GgufHeader, FamilyAdapter, ModelConfig, list[str]]:
    """Scan ``path``, read its config, and check every tensor against it before anything is
    built (see the module docstring): the header, family, config and notices of a file that
    fits; one line naming the first problem otherwise."""
    header = scan(path)
    family, cfg, notices = config_from_gguf(header)
    where = f"tensors in {header.path}"
    labels = ("block_count", "blocks in the file")
    check_blocks(header.tensors, _BLOCK, cfg.n_layer, f"{where} do not fit the metadata", labels)
    meta = {n: torch.empty(t.shape, device="meta") for n, t in header.tensors.items()}
    try:
        with shapes_only():
            ours = family.from_gguf(meta, cfg)  # split/joined on the meta device: shapes only
    except RuntimeError as exc:
        raise LmcliError(f"{where} do not fit the metadata ({str(exc).splitlines()[0][:200]})") from None
    mapped = {k: ("F32", tuple(v.shape)) for k, v in ours.items()}  # dequantized to float when read
    stored = sum(t.n_bytes for t in header.tensors.values())
    weights = WeightsHeader(header.path, mapped, header.file_size - header.data_offset)
    check_header(cfg, weights, where=where, stored_dtypes=True, stored_bytes=stored)
    return header, family, cfg, notices
