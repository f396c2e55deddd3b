"""Model FLOPs utilization: the share of the device's peak arithmetic that training achieves.

The estimate is the one nanoGPT reports (after the PaLM paper's appendix B): a training token
costs ``6 N + 12 L H Q T`` FLOPs, N the parameters that multiply (every weight matrix, the
vocabulary projection included, the embedding lookups not), L layers, H heads of size Q, T the
context. 6 N is 2 N forward, 2 N for the gradient of each layer's input and 2 N for the
gradient of its weights: weights that do not train (a LoRA run's frozen base) cost no weight
gradient, so they count 4 N. The peak is a GPU's dense bf16 tensor-core rate from its datasheet
(``PEAK_TFLOPS``), ``--peak-tflops`` when given, and on a CPU the best float32 matmul rate of a
few sizes measured for about half a second at the start (small products run far below the
CPU's peak: measured on 512² alone, a run's larger products showed an MFU over 100%), so the
figure is there on every device (on a CPU it says how close the run comes to the CPU's own
matmul speed). A probe is a lower bound of the peak (a busy machine, a short timing, shapes
other than the run's: the Multi30k recipe showed 110.7%), so a measured peak is raised to the
best rate the run itself reaches: a utilization never exceeds 100%.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from lmcli.config.model import ModelConfig

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


PROBE_RAISED = "the best rate of this run (above its float32 matmul probe)"


def flops_per_token(
    cfg: ModelConfig, matmul_params: int, tokens_per_example: int | None = None, trained: int | None = None
) -> float:
    """Training FLOPs (forward and backward) per token: 6 N + 12 L H Q T; with ``trained`` (the
    matmul parameters that train, fewer than N), 4 N + 2 trained + 12 L H Q T."""
    T = tokens_per_example or cfg.block_size
    weights = 6.0 * matmul_params if trained is None else 4.0 * matmul_params + 2.0 * trained
    return weights + 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * T


def matmul_params(model: torch.nn.Module, trained_only: bool = False) -> int:
    """Parameters that take part in a matrix product per token: all but the embedding tables
    (the vocabulary projection counts once, tied or not, over the logical vocabulary: rows
    padded for speed are work the model does not need, so they never raise the MFU);
    ``trained_only``: those of them that train."""
    cfg = model.config
    if not trained_only:
        return model.num_parameters(non_embedding=True) + cfg.vocab_size * cfg.n_embd
    head = model.lm_head.weight.requires_grad
    embeddings = {id(model.wte.weight), id(getattr(getattr(model, "wpe", None), "weight", None))}
    trained = sum(
        p.numel() for p in model.parameters() if p.requires_grad and p.dim() > 1 and id(p) not in embeddings
    )
    return trained + (cfg.vocab_size * cfg.n_embd if head else 0)


def gpu_peak_tflops(name: str) -> float | None:
    """The datasheet peak of a GPU named ``name`` (``torch.cuda.get_device_name``), None if unknown."""
    for key, peak in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peak
    return None


@functools.lru_cache(maxsize=4)
def measured_cpu_tflops(seconds: float = 0.5, size: int = 2048) -> float:
    """The float32 matmul rate of this CPU with torch's threads: the best of square products of
    ``size / 4``, ``size / 2`` and ``size``, each timed for a third of ``seconds`` (at least one
    product), once per process. Its operands come from a generator of its own: the global RNG,
    which a resumed run has just restored, is not touched."""
    g = torch.Generator().manual_seed(0)
    best = 0.0
    for n in (size // 4, size // 2, size):
        a = torch.randn(n, n, generator=g)
        b = torch.randn(n, n, generator=g)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm up
        done, start = 0, time.perf_counter()
        while done == 0 or time.perf_counter() - start < seconds / 3:
            torch.mm(a, b, out=out)
            done += 1
        best = max(best, 2.0 * n**3 * done / max(time.perf_counter() - start, 1e-9) / 1e12)
    return best


def peak_tflops(device: torch.device, override: float | None = None) -> tuple[float | None, str]:
    """The peak TFLOP/s MFU is measured against on ``device``, and where it comes from."""
    if override is not None:
        return override, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        return peak, f"{name} datasheet" if peak else f"{name}: unknown peak (give --peak-tflops)"
    if device.type == "cpu":
        return measured_cpu_tflops(), "float32 matmul, measured at start (raised if the run goes faster)"
    return None, f"{device.type}: unknown peak (give --peak-tflops)"


@dataclass
class MfuBasis:
    """What a run's MFU is measured against: its training FLOPs per token and one device's peak
    (None: unknown), with where that peak comes from. A ``probed`` peak (a CPU's, measured) is
    raised to any rate the run achieves above it, so the MFU stays at most 1."""

    flops_per_token: float
    peak_tflops: float | None
    peak_source: str
    probed: bool = False

    @classmethod
    def on(cls, device: torch.device, per_token: float, override: float | None = None) -> MfuBasis:
        """The basis of a run on ``device``: a datasheet's peak, ``--peak-tflops``, or a probe's."""
        peak, source = peak_tflops(device, override)
        return cls(per_token, peak, source, probed=override is None and device.type == "cpu")

    def of(self, tokens_per_s: float, devices: int = 1) -> float | None:
        achieved = tokens_per_s * self.flops_per_token / (1e12 * devices)  # TFLOP/s per device
        if self.probed and self.peak_tflops is not None and achieved > self.peak_tflops:
            self.peak_tflops = achieved
            self.peak_source = PROBE_RAISED
        return mfu(tokens_per_s, self.flops_per_token, self.peak_tflops, devices)


def mfu(tokens_per_s: float, per_token: float, peak: float | None, devices: int = 1) -> float | None:
    """Achieved FLOP/s over the peak of ``devices`` devices (0..1), None without a peak."""
    if not peak:
        return None
    return tokens_per_s * per_token / (peak * 1e12 * devices)
