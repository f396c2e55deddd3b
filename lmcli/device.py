"""The device a command runs on and its numeric precision (autocast, TF32)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def usable_cpus() -> int:
    """The CPUs this process may actually use: its affinity mask, capped by the cgroup's CPU
    quota (``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` of v1) rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time per period the cgroup allows (None: no limit, or not known)."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def default_threads() -> int:
    """``--threads``' default: ``$OMP_NUM_THREADS`` when it is set (the variable users set to
    share a machine, which torch reads too), else ``usable_cpus()``."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else usable_cpus()


def set_threads(threads: int | None) -> int:
    """Give torch ``threads`` CPU threads (None: ``default_threads()``) and return the number.

    More threads than the machine has CPUs are refused: torch's threads spin while they wait,
    so each thread beyond a free core slows every step instead of helping.
    """
    n = default_threads() if threads is None else threads
    limit = os.cpu_count() or 1
    if n > limit:
        raise LmcliError(f"--threads {n} is more than the {limit} CPUs of this machine")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def autocast_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """The training autocast dtype for ``--dtype`` (None = plain float32). ``auto``: bf16 on a
    GPU that computes it natively, else float16 (with a GradScaler); float32 elsewhere."""
    if dtype == "auto":
        if device.type == "cuda":
            return auto_cuda_dtype(torch.cuda.is_bf16_supported(including_emulation=False))
        return None
    if dtype == "float32":
        return None
    if dtype == "float16" and device.type == "cpu":
        raise LmcliError("--dtype float16 needs a GPU; use bfloat16 or float32 on the CPU")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def auto_cuda_dtype(native_bf16: bool) -> torch.dtype:
    """``--dtype auto`` on a GPU: bf16 where the tensor cores compute it (Ampere, sm_80, and
    later), float16 where bf16 would only be emulated in float32 (V100, T4: sm_70/75)."""
    return torch.bfloat16 if native_bf16 else torch.float16


def inference_dtype(device: torch.device, dtype: str, weights: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of eval, sample, beam and serve (None: run in the weights' dtype).

    Training's policy: on a GPU, float32 weights compute under bf16 (or float16) autocast unless
    ``--dtype float32`` asks for full precision (TF32 matmuls then); 16-bit weights need none.
    On the CPU inference stays float32 unless the weights were loaded in a 16-bit dtype.
    """
    if device.type != "cuda" or dtype == "float32" or weights != torch.float32:
        return None
    if dtype == "auto":
        return auto_cuda_dtype(torch.cuda.is_bf16_supported(including_emulation=False))
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def configure_backend(device: torch.device) -> None:
    """Fast-math settings of every command on a GPU: TF32 for float32 matmuls and convolutions
    (``set_float32_matmul_precision("high")``); bf16 autocast does the rest. Nothing on a CPU."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True


@contextlib.contextmanager
def precision(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """A command's numeric scope: the backend settings and autocast to ``dtype`` (None: none)."""
    configure_backend(device)
    with autocast(device, dtype):
        yield


def compute_dtype(device: torch.device, weights: torch.dtype) -> torch.dtype:
    """The dtype activations have here: the autocast dtype when autocast is on, else the
    weights' (what a KV cache should hold, so no step casts it)."""
    if weights.is_floating_point and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weights


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


def release_freed_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Weights freed one by one while packed or quantized copies are made leave free
    chunks in the heap that the process would otherwise keep (and count) for its lifetime: 50 MB
    for a 135M-parameter model packed in place (``lmcli.model.fastpath``), more when quantized."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def memory_of(device: torch.device) -> int | None:
    """Bytes of memory of ``device`` (a GPU's own, else the machine's RAM), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


class Staging:
    """Host-to-device copies of batches through reusable page-locked ("pinned") buffers.

    Each kind of tensor (``name``: a batch's tokens, its index, ...) has two flat buffers used
    in turn (double buffering): a batch is written into one while the previous batch's copy
    out of the other may still be in flight; a buffer is refilled only after its last copy
    finished (a CUDA event). A buffer grows to the largest tensor of its kind and is viewed in
    the shape at hand, so batches whose shapes vary (length buckets, scored positions) reuse it
    and memory stays bounded. One ``non_blocking`` copy per tensor; callers slice views
    (inputs, targets) on the device. On a CPU nothing is staged (a batch is already where it
    is used) unless ``pin`` is given: ``pin=False`` stages through ordinary memory with
    synchronous copies (same values, same reuse: what a CPU test exercises).
    """

    def __init__(self, device: torch.device, pin: bool | None = None) -> None:
        self.device = device
        self.staged = device.type == "cuda" or pin is not None
        self.pin = device.type == "cuda" if pin is None else pin
        self._buffers: dict[tuple[str, torch.dtype], list[torch.Tensor | None]] = {}
        self._turn: dict[tuple[str, torch.dtype], int] = {}
        self._done: dict[int, Any] = {}  # buffer data_ptr -> the CUDA event of its last copy

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, name: str = "tensor") -> torch.Tensor:
        """The next of the two ``name`` buffers, free to be overwritten, viewed as ``shape``."""
        key = (name, dtype)
        pair = self._buffers.setdefault(key, [None, None])
        turn = self._turn.get(key, 0)
        self._turn[key] = 1 - turn
        buf = pair[turn]
        if buf is not None:
            event = self._done.pop(buf.data_ptr(), None)
            if event is not None:
                event.synchronize()  # the copy that read it last has finished
        n = math.prod(shape)
        if buf is None or buf.numel() < n:
            buf = pair[turn] = torch.empty(n, dtype=dtype, pin_memory=self.pin)
        return buf[:n].view(shape)

    def to_device(self, t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """A device copy of ``t`` made through a ``name`` staging buffer (one copy on the device)."""
        if not self.staged:
            return t
        buf = self.buffer(tuple(t.shape), t.dtype, name)
        buf.copy_(t)
        out = buf.to(self.device, non_blocking=self.pin, copy=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._done[buf.data_ptr()] = event
        return out


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` on the CPU, with one wait for the device instead of one per tensor."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    out = [t.to("cpu", non_blocking=True) for t in tensors]
    for t in tensors:  # the copies were queued on the device's stream: wait once
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
            break
    return out
