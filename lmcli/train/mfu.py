"""Model FLOPs utilization: the share of the device's peak arithmetic that training achieves.

The estimate is the one nanoGPT reports (after the PaLM paper's appendix B): a training token
costs ``6 N + 12 L H Q T`` FLOPs, N the parameters that multiply (every weight matrix, the
vocabulary projection included, the embedding lookups not), L layers, H heads of size Q, T the
context. The peak is a GPU's dense bf16 tensor-core rate from its datasheet (``PEAK_TFLOPS``),
``--peak-tflops`` when given, and on a CPU a float32 matmul rate measured for about a second at
the start, so the figure is there on every device (on a CPU it says how close the run comes to
the CPU's own matmul speed).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from lmcli.config import ModelConfig

# Dense (no sparsity) bf16 tensor-core TFLOP/s from the vendors' datasheets; float16 for the
# GPUs without native bf16 (V100, T4), where lmcli trains in float16. First match wins: the
# more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("B200", 2250.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A40", 149.7),
    ("A30", 165.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("RTX 6000 Ada", 364.0),
    ("RTX A6000", 154.8),
    ("RTX 4090", 165.2),
    ("V100", 125.0),  # float16
    ("T4", 65.0),  # float16
)


def flops_per_token(cfg: ModelConfig, matmul_params: int, tokens_per_example: int | None = None) -> float:
    """Training FLOPs (forward and backward) per token: 6 N + 12 L H Q T."""
    T = tokens_per_example or cfg.block_size
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * T


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in a matrix product per token: all but the embedding tables
    (the vocabulary projection counts once, tied or not, over the logical vocabulary: rows
    padded for speed are work the model does not need, so they never raise the MFU)."""
    cfg = model.config
    return model.num_parameters(non_embedding=True) + cfg.vocab_size * cfg.n_embd


def gpu_peak_tflops(name: str) -> float | None:
    """The datasheet peak of a GPU named ``name`` (``torch.cuda.get_device_name``), None if unknown."""
    for key, peak in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peak
    return None


@functools.lru_cache(maxsize=4)
def measured_cpu_tflops(seconds: float = 0.3, size: int = 512) -> float:
    """The float32 matmul rate of this CPU with torch's threads, measured for ``seconds`` once
    per process (a 512² product takes a few ms: about a hundred of them). Its operands come
    from a generator of its own: the global RNG, which a resumed run has just restored, is not
    touched."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm up
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(4):
            torch.mm(a, b, out=out)
        done += 4
    return 2.0 * size**3 * done / elapsed / 1e12


def peak_tflops(device: torch.device, override: float | None = None) -> tuple[float | None, str]:
    """The peak TFLOP/s MFU is measured against on ``device``, and where it comes from."""
    if override is not None:
        return override, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        return peak, f"{name} datasheet" if peak else f"{name}: unknown peak (give --peak-tflops)"
    if device.type == "cpu":
        return measured_cpu_tflops(), "float32 matmul, measured"
    return None, f"{device.type}: unknown peak (give --peak-tflops)"


@dataclass(frozen=True)
class MfuBasis:
    """What a run's MFU is measured against: its training FLOPs per token and one device's peak
    (None: unknown), with where that peak comes from."""

    flops_per_token: float
    peak_tflops: float | None
    peak_source: str

    def of(self, tokens_per_s: float, devices: int = 1) -> float | None:
        return mfu(tokens_per_s, self.flops_per_token, self.peak_tflops, devices)


def mfu(tokens_per_s: float, per_token: float, peak: float | None, devices: int = 1) -> float | None:
    """Achieved FLOP/s over the peak of ``devices`` devices (0..1), None without a peak."""
    if not peak:
        return None
    return tokens_per_s * per_token / (peak * 1e12 * devices)
