"""The device a command runs on and its numeric precision (autocast, TF32)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from lmcli.errors import LmcliError


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device must be available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LmcliError("--device cuda requested but CUDA is not available")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise LmcliError("--device mps requested but MPS is not available")
    return torch.device(name)


def autocast_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """The autocast dtype for ``--dtype`` (None = plain float32). ``auto``: bf16 on CUDA."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return None
    if dtype == "float32":
        return None
    if dtype == "float16" and device.type == "cpu":
        raise LmcliError("--dtype float16 needs a GPU; use bfloat16 or float32 on the CPU")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def configure_backend(device: torch.device) -> None:
    """Fast-math settings: TF32 matmuls on CUDA (bf16 autocast does the rest)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """With ``enabled``, torch's deterministic algorithms for the scope (ops without one warn).

    On the CPU lmcli's training is bit-for-bit repeatable without it; on CUDA some kernels
    (atomic adds in backward passes, cuBLAS workspaces) are not, unless this is on.
    """
    if not enabled:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    workspace_set = "CUBLAS_WORKSPACE_CONFIG" in os.environ
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if not workspace_set:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def memory_of(device: torch.device) -> int | None:
    """Bytes of memory of ``device`` (a GPU's own, else the machine's RAM), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None
