"""Importance matrices as llama.cpp stores them: read (its GGUF layout and the older ``.dat``),
written (the GGUF layout), and turned into each tensor's importance weights.

The GGUF layout (llama.cpp's ``tools/imatrix``): ``general.type = "imatrix"``, the keys
``imatrix.datasets`` (the calibration files' names), ``imatrix.chunk_count`` and
``imatrix.chunk_size`` (the windows of tokens it was computed on), and for each matrix named by its
GGUF tensor name two F32 tensors: ``NAME.in_sum2``, the per-column sums of squares of its inputs,
(1, columns), and ``NAME.counts``, how many input rows they sum, (1, 1). The ``.dat`` layout:
int32 entries, then per entry an int32-prefixed name, int32 ``ncall``, int32 ``nval`` and ``nval``
floats (the mean squares times ``ncall``), optionally the chunk count and the dataset's name.

``weights(name)`` is what llama-quantize hands its quantizer for that tensor: the sums divided by
the count (GGUF; a count of 0: ones), or the ``.dat`` values divided by ``ncall``: float32 division,
as llama-quantize's ``load_imatrix`` does, so the same file gives the same bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmcli.errors import LmcliError
from lmcli.formats.gguf.check import MAGIC, scan
from lmcli.safe_io import open_input, published

SUMS, COUNTS = ".in_sum2", ".counts"
NAME_LIMIT = 4096  # bytes of a tensor's name in a .dat file
VALUE_LIMIT = 1 << 28  # values of one .dat entry


@dataclass
class ImportanceMatrix:
    """Per matrix (GGUF tensor name): its inputs' per-column sums of squares and row count."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)  # (columns,) float32
    counts: dict[str, float] = field(default_factory=dict)  # input rows summed (.dat: ncall)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False  # read from a .dat file: ``sums`` hold mean squares x ncall
    source: str = ""  # the file it was read from (an exported file names it)

    def weights(self, name: str) -> np.ndarray | None:
        """Tensor ``name``'s importance weights as llama-quantize computes them (None: no entry)."""
        if name not in self.sums:
            return None
        sums, count = self.sums[name], self.counts[name]
        if self.legacy:
            return sums / np.float32(count) if count > 0 else sums.copy()
        rows = math.floor(count + 0.5)  # (C's lround of the stored float)
        return sums / np.float32(rows) if rows > 0 else np.ones_like(sums)

    def add(self, name: str, squares: np.ndarray, rows: int) -> None:
        """Add ``rows`` input rows' per-column sums of squares to matrix ``name``."""
        if name in self.sums:
            self.sums[name] = (self.sums[name] + squares).astype(np.float32)
            self.counts[name] += rows
        else:
            self.sums[name] = np.asarray(squares, dtype=np.float32)
            self.counts[name] = float(rows)


def read_imatrix(path: str | Path) -> ImportanceMatrix:
    """An importance matrix file, GGUF or ``.dat``; one line naming what is wrong with it."""
    path = Path(path)
    with open_input(path, "importance matrix") as f:
        magic = f.read(4)
    found = _read_gguf(path) if magic == MAGIC else _read_dat(path)
    found.source = str(path)
    if not found.sums:
        raise LmcliError(f"{path}: the importance matrix holds no entries")
    for name, sums in found.sums.items():
        if not np.isfinite(sums).all() or not math.isfinite(found.counts[name]):
            raise LmcliError(f"{path}: the importance matrix of {name} holds a non-finite value")
    return found


def _read_gguf(path: Path) -> ImportanceMatrix:
    header = scan(path)  # every count and offset bounded by the file
    meta = header.metadata
    if meta.get("general.type") != "imatrix":
        raise LmcliError(f"{path} is a GGUF file but no importance matrix (general.type is not 'imatrix')")
    missing = [k for k in ("imatrix.chunk_count", "imatrix.chunk_size") if k not in meta]
    if missing or "imatrix.datasets" not in header.arrays:
        raise LmcliError(f"{path}: the importance matrix lacks {', '.join(missing) or 'imatrix.datasets'}")
    datasets = header.array("imatrix.datasets")
    out = ImportanceMatrix(datasets=[str(d) for d in datasets], chunk_count=int(meta["imatrix.chunk_count"]))
    out.chunk_size = int(meta["imatrix.chunk_size"])
    names = {n.removesuffix(SUMS) for n in header.tensors if n.endswith(SUMS)}
    names |= {n.removesuffix(COUNTS) for n in header.tensors if n.endswith(COUNTS)}
    with open_input(path, "importance matrix") as f:
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        for name in sorted(names):
            sums, counts = header.tensors.get(name + SUMS), header.tensors.get(name + COUNTS)
            if sums is None or counts is None:
                raise LmcliError(f"{path}: {name} has {'no sums' if sums is None else 'no counts'}")
            if sums.type_name != "F32" or counts.type_name != "F32":
                raise LmcliError(f"{path}: the sums and counts of {name} must be F32")
            n_mat = math.prod(counts.shape)
            if n_mat != 1 or sums.shape[0] != 1:
                raise LmcliError(
                    f"{path}: {name} holds {n_mat} matrices (experts), which lmcli does not write"
                )
            view = mm[sums.offset : sums.offset + sums.n_bytes].view(np.float32)
            out.sums[name] = np.array(view)
            out.counts[name] = float(mm[counts.offset : counts.offset + 4].view(np.float32)[0])
    return out


def _read_dat(path: Path) -> ImportanceMatrix:
    data = path.read_bytes()
    where, pos = str(path), 0

    def take(fmt: str, what: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise LmcliError(f"{where}: not an importance matrix (GGUF or .dat): it ends inside {what}")
        pos += size
        return struct.unpack_from(fmt, data, pos - size)

    (entries,) = take("<i", "the entry count")
    if entries < 1 or entries > len(data) // 16:
        raise LmcliError(f"{where}: not an importance matrix (GGUF or .dat): {entries} entries")
    out = ImportanceMatrix(legacy=True)
    for _ in range(entries):
        (size,) = take("<i", "a name's length")
        if not 0 < size <= NAME_LIMIT:
            raise LmcliError(f"{where}: not an importance matrix (GGUF or .dat): a name of {size} bytes")
        name = take(f"<{size}s", "a name")[0].decode("utf-8", "replace")
        ncall, nval = take("<ii", f"the sizes of {name}")
        if not 0 < nval <= VALUE_LIMIT:
            raise LmcliError(f"{where}: {name} has {nval} values")
        if pos + 4 * nval > len(data):
            raise LmcliError(
                f"{where}: not an importance matrix (GGUF or .dat): it ends inside {name}'s values"
            )
        out.sums[name] = np.frombuffer(data, np.float32, nval, pos).copy()
        pos += 4 * nval
        out.counts[name] = float(ncall)
    if pos + 8 <= len(data):  # the optional chunk count and dataset name
        (out.chunk_count, size) = struct.unpack_from("<ii", data, pos)
        if 0 < size <= len(data) - pos - 8:
            out.datasets.append(data[pos + 8 : pos + 8 + size].decode("utf-8", "replace"))
    return out


def write_imatrix(matrix: ImportanceMatrix, out: str | Path) -> Path:
    """``matrix`` as a GGUF importance matrix file ``out`` (a new file, written whole or not at all)."""
    import gguf

    out = Path(out)
    if out.exists() or out.is_symlink():
        raise LmcliError(f"{out} already exists: choose a new file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    with published(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), "imatrix")
        w.kv_data[0].pop("general.architecture", None)  # (llama.cpp's imatrix files have none)
        w.add_string("general.type", "imatrix")
        w.add_array("imatrix.datasets", matrix.datasets)
        w.add_uint32("imatrix.chunk_count", matrix.chunk_count)
        w.add_uint32("imatrix.chunk_size", matrix.chunk_size)
        for name in sorted(matrix.sums):
            w.add_tensor(name + SUMS, matrix.sums[name].astype(np.float32).reshape(1, -1))
            w.add_tensor(name + COUNTS, np.array([[matrix.counts[name]]], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def check_against(matrix: ImportanceMatrix, columns: dict[str, int], where: str) -> None:
    """One line when the matrix does not fit the model: an entry no tensor of the model has, or
    of another width (``columns``: the model's matrices, GGUF name -> columns); entries for a few
    of them (llama.cpp's leave the vocabulary out) are fine, none at all is not."""
    if not any(name in columns for name in matrix.sums):
        some = ", ".join(sorted(matrix.sums)[:2])
        raise LmcliError(
            f"{where}: no entry of the importance matrix ({some}, ...) is a tensor of this model"
        )
    for name, sums in matrix.sums.items():
        if name not in columns:
            raise LmcliError(f"{where}: the importance matrix has {name}, which this model does not")
        if sums.shape[0] != columns[name]:
            raise LmcliError(
                f"{where}: the importance matrix has {sums.shape[0]} columns for {name}, "
                f"the model {columns[name]}"
            )
