"""The library's C ABI from Python: the ctypes aliases, the mirrors of ``abi.h``'s structures, the
functions' signatures, and ``bind``, which reads the library's own report of itself when it loads
(its version, names, structure layouts and block formats) and refuses, in one line, a library that
does not match what this side was written for.

``abi.h`` declares each fact once (the instruction sets, the gated MLP's nonlinearities, the cache
types as X-macro lists; ``LmLinear``/``LmLayer``); what Python needs of it is read from the
library (the names) or checked against it (the structures' offsets and sizes, the block formats'
sizes, by ``ops``, against gguf's).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from lmcli.errors import LmcliError

VERSION = 3  # lmcli_native_version() of the library this module binds
i64, i32, f64, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_void_p
NAME_LISTS = ("isas", "acts", "cache_types")  # lmabi::NameList, in order


class LmLinear(ctypes.Structure):
    _fields_ = [("wtype", i64), ("w", ptr), ("n", i64), ("k", i64), ("bias", ptr)]


class LmLayer(ctypes.Structure):
    _fields_ = [
        *((name, i64) for name in ("C", "H", "KV", "D", "F", "act", "nqkv", "window")),
        *((name, f64) for name in ("eps", "qk_eps", "scale", "softcap")),
        *((name, ptr) for name in ("norm1", "norm2", "post1", "post2", "q_norm", "k_norm")),
        ("qkv", LmLinear * 3),
        *((name, LmLinear) for name in ("o", "gate", "up", "down")),
    ]


STRUCTS = {"LmLinear": LmLinear, "LmLayer": LmLayer}

# each exported function's (argument types, result type)
SIGNATURES = {
    "lmcli_native_version": ([], i32),
    "lmcli_native_supported": ([i32], i32),
    "lmcli_native_best_isa": ([], i32),
    "lmcli_native_name": ([i32, i32], ctypes.c_char_p),
    "lmcli_native_field": ([i32, *[ctypes.POINTER(t) for t in (ctypes.c_char_p,) * 2 + (i64,) * 2]], i32),
    "lmcli_native_format_count": ([], i32),
    "lmcli_native_format": (
        [i32, ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_char_p), *[ctypes.POINTER(i32)] * 4],
        i32,
    ),
    "lmcli_native_pool_threads": ([i32], i32),
    # (type, blocks, n, k, x, m, y, threads, instruction set)
    "lmcli_native_matmul": ([i32, ptr, i64, i64, ptr, i64, ptr, i32, i32], i32),
    # (type, blocks, n, k, out, threads, instruction set)
    "lmcli_native_dequantize": ([i32, ptr, i64, i64, ptr, i32, i32], i32),
    # (type, blocks, rows, k, ids, n, out)
    "lmcli_native_weight_rows": ([i32, ptr, i64, i64, ptr, i64, ptr], i32),
    # (layer, x, rows, cos rows, sin rows, start, k, v, cache type, columns, column, threads, instruction set)
    "lmcli_native_layer_step": (
        [ctypes.POINTER(LmLayer), ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32],
        i32,
    ),
}


@dataclass(frozen=True)
class LibFormat:
    """A row of the library's block-format table (formats.h)."""

    ggml_type: int
    block: int
    block_bytes: int
    align: int
    products: bool  # the library multiplies (and dequantizes) it


@dataclass(frozen=True)
class Report:
    """What the library says of itself: its names (index = the library's number) and formats."""

    isas: tuple[str, ...]
    acts: tuple[str, ...]
    cache_types: tuple[str, ...]  # torch's dtype names
    best_isa: int
    formats: dict[str, LibFormat]  # by ggml's name (lower case: "q4_K")


def _names(lib: ctypes.CDLL, which: int) -> tuple[str, ...]:
    out = []
    while (name := lib.lmcli_native_name(which, len(out))) is not None:
        out.append(name.decode())
    return tuple(out)


def _check_structs(lib: ctypes.CDLL) -> None:
    """Raises LmcliError unless every structure and field the library reports has the offset and
    size of this module's mirror (and the mirror has no field the library lacks)."""
    seen: dict[str, set[str]] = {name: set() for name in STRUCTS}
    kind, field, offset, size = ctypes.c_char_p(), ctypes.c_char_p(), i64(), i64()
    i = 0
    while lib.lmcli_native_field(i, kind, field, offset, size) == 0:
        i += 1
        s, f = kind.value.decode(), field.value.decode()
        mirror = STRUCTS.get(s)
        if f == "":
            got = None if mirror is None else (0, ctypes.sizeof(mirror))
        else:
            desc = getattr(mirror, f, None)
            got = None if desc is None else (desc.offset, desc.size)
            seen.setdefault(s, set()).add(f)
        if got != (offset.value, size.value):
            what = s if f == "" else f"{s}.{f}"
            raise LmcliError(f"its {what} is {size.value} bytes at {offset.value}, lmcli's mirror {got}")
    for name, mirror in STRUCTS.items():
        missing = {f for f, *_ in mirror._fields_} - seen[name]
        if missing:
            raise LmcliError(f"its {name} lacks {', '.join(sorted(missing))}")


def _formats(lib: ctypes.CDLL) -> dict[str, LibFormat]:
    out = {}
    t, block, size, align, products = i32(), i32(), i32(), i32(), i32()
    name = ctypes.c_char_p()
    for i in range(lib.lmcli_native_format_count()):
        lib.lmcli_native_format(i, t, name, block, size, align, products)
        out[name.value.decode()] = LibFormat(
            t.value, block.value, size.value, align.value, bool(products.value)
        )
    return out


def bind(lib: ctypes.CDLL) -> Report:
    """Declare every function's signature on ``lib``, then read and check its report. Raises
    LmcliError (one line, what differs) for a library of another version or layout."""
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise LmcliError(f"it has no {name}")
        fn.argtypes, fn.restype = args, result
    version = lib.lmcli_native_version()
    if version != VERSION:
        raise LmcliError(f"it is version {version}, lmcli binds version {VERSION}")
    _check_structs(lib)
    isas, acts, caches = (_names(lib, n) for n in range(len(NAME_LISTS)))
    return Report(isas, acts, caches, lib.lmcli_native_best_isa(), _formats(lib))
