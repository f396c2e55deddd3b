"""Compile the native sources (the kernels, kernels.cpp and its .inc bodies; the quantizer,
quantize.cpp and its parts) into one shared library, cached by hash.

The library lands in ``$LMCLI_NATIVE_DIR`` or ``~/.cache/lmcli/native``, named by a hash of the
sources, the compiler and its flags, so an edited source or another compiler builds anew and a
built one is reused. No ``-march``: the instruction set is picked at run time inside the library.
``sanitize=True`` builds with AddressSanitizer and UBSan (``make check-native``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from lmcli.errors import LmcliError

HERE = Path(__file__).resolve().parent
UNITS = ("kernels.cpp", "quantize.cpp")  # the translation units, compiled together
SOURCES = (
    *("formats.h", "simd_body.inc", "neon_body.inc", "layer.inc", "layer_math.inc"),
    *("quantize_k.inc", "quantize_iq4.inc", "quantize_x8.inc", *UNITS),
)  # every file the library is built from: each is hashed into its name
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno")
SANITIZE_FLAGS = (
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
)
COMPILERS = ("c++", "g++", "clang++")
BUILD_TIMEOUT_S = 300


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LMCLI_NATIVE_DIR`` or ``~/.cache/lmcli/native``."""
    env = os.environ.get("LMCLI_NATIVE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lmcli" / "native"


def compiler() -> str | None:
    """``$CXX`` if set, else the first C++ compiler on PATH, else None."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((path for name in COMPILERS if (path := shutil.which(name))), None)


def flags(sanitize: bool = False) -> list[str]:
    return [*FLAGS, *(SANITIZE_FLAGS if sanitize else ())]


def library_path(cxx: str, sanitize: bool = False) -> Path:
    """The cache path of the library these sources, this compiler and these flags build."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    h.update(" ".join([os.path.realpath(cxx), *flags(sanitize)]).encode())
    tag = "-asan" if sanitize else ""
    return cache_dir() / f"liblmcli_native-{h.hexdigest()[:16]}{tag}.so"


def build(sanitize: bool = False, force: bool = False) -> Path:
    """The built library's path, compiling it first unless it is in the cache (or ``force``).

    Raises LmcliError with the compiler's last line when there is no compiler or it fails."""
    cxx = compiler()
    if cxx is None:
        raise LmcliError("no C++ compiler found (set CXX, or install g++ or clang++)")
    out = library_path(cxx, sanitize)
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # builders racing each rename a whole file
    cmd = [cxx, *flags(sanitize), "-o", str(tmp), *(str(HERE / unit) for unit in UNITS)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LmcliError(f"native kernels: {cxx} failed to run ({e})") from None
    if proc.returncode != 0:
        lines = (
            [line for line in proc.stderr.splitlines() if "error" in line]
            or proc.stderr.splitlines()
            or ["?"]
        )
        tmp.unlink(missing_ok=True)
        raise LmcliError(f"native kernels: {Path(cxx).name} failed: {lines[0].strip()}")
    os.replace(tmp, out)
    return out
