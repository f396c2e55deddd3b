"""One screen of facts before training: size, data, memory and time estimates."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.model import lora
from lmcli.model import skeleton as skeletons
from lmcli.model.transformer import Transformer
from lmcli.tasks import make_task
from lmcli.train.parallel import (
    per_process_memory,
)


@dataclass(frozen=True)
class Preflight:
    params: int
    params_non_embedding: int
    tokens_per_step: int
    train_tokens: int
    val_tokens: int
    max_steps: int | None
    max_time: float | None
    memory_bytes: int
    available_bytes: int | None
    step_seconds: float | None  # measured on one probe step; None when not measured
    processes: int = 1  # the memory figures are per process

    @property
    def epochs(self) -> float | None:
        if self.max_steps is None:
            return None
        return self.max_steps * self.tokens_per_step / max(self.train_tokens, 1)

    @property
    def eta_seconds(self) -> float | None:
        times = []
        if self.step_seconds is not None and self.max_steps is not None:
            times.append(self.step_seconds * self.max_steps)
        if self.max_time is not None:
            times.append(self.max_time)
        return min(times) if times else None


def estimate_memory(
    cfg: ModelConfig,
    params: int,
    batch_size: int,
    autocast: bool,
    flash: bool = False,
    trainable: int | None = None,
    context: int | None = None,
    *,
    shards: int = 1,
    recompute: str = "none",
) -> int:
    """Bytes of one process for weights, gradients, AdamW moments and activations of one
    micro-batch (rough); gradients and moments for the ``trainable`` parameters alone (LoRA;
    None: all of them); ``context``: the longest sequence a batch holds (None: the block size;
    SFT and translation examples are often far shorter than an imported model's context).

    With ``shards`` processes sharing the parameters (FSDP), each holds 1/shards of the
    weights, gradients and moments, plus the unsharded parameters in use: the root's
    (embeddings, head) and two blocks' (one computing, one prefetched).

    Activations follow Korthikanti et al. (34·B·T·C + 5·H·B·T² values per layer, its
    queries, keys, values and attention output counted at their widths (``q_width``, ``n_kv_head
    x head_dim``) rather than C each, halved
    under 16-bit autocast; with ``flash`` attention, which never stores the T×T scores, the
    second term goes) plus the logits: the logits, their float32 copy or log-softmax kept for
    the backward, and their gradient (12 bytes a value). ``recompute`` (activation
    checkpointing): ``full`` keeps each block's input (2·B·T·C) and one block's whole
    activations at a time; ``selective`` keeps each block's input and the outputs of its linear
    layers and attention kernel (2·B·T·(5C + 2·kv + ffn, twice ffn when gated) at 16 bits) plus
    one block's recomputed ops.
    """
    B, T, C, H = batch_size, context or cfg.block_size, cfg.n_embd, cfg.n_head
    trained = params if trainable is None else trainable
    state = (params * 4 + trained * 4 * 3) // shards  # fp32 weights; grads and two Adam moments
    if shards > 1:
        root = cfg.padded_vocab_size * C * (1 if cfg.tie_embeddings else 2) + cfg.block_size * C
        block = max(params - root, 0) // cfg.n_layer
        state += (root + 2 * block) * 4
    act_bytes = 2 if autocast else 4
    scores = 0 if flash else 5 * H * B * T * T
    # 34·C a column when the heads are C wide; queries, keys, values and the attention's output
    # (8·C of it) are 4·q_width + 4·kv with a free head size and grouped key/value heads
    kv = cfg.n_kv_head * cfg.head_dim
    layer = (
        B * T * (26 * C + 4 * cfg.q_width + 4 * kv) + scores
    )  # bytes of one block's activations at 16 bits
    if recompute == "full":
        kept = cfg.n_layer * 2 * B * T * C + layer
    elif recompute == "selective":
        ffn = cfg.ffn_dim * (2 if cfg.mlp == "swiglu" else 1)
        kept = cfg.n_layer * 2 * B * T * (5 * C + 2 * kv + ffn) + layer
    else:
        kept = cfg.n_layer * layer
    activations = kept * act_bytes // 2
    logits = B * T * cfg.padded_vocab_size * 12  # the head computes the padded rows too
    return state + activations + logits


def measured_memory(peak_allocated: int, params: int) -> int:
    """Bytes a GPU run needs, from a probe step: the allocator's peak during a forward and
    backward (weights, gradients, activations, logits, as the kernels really store them) plus
    the AdamW moments, which the probe's step never allocated (8 bytes a parameter)."""
    return peak_allocated + 8 * params


def available_memory(device: torch.device) -> int | None:
    """Memory the run may use: a GPU's total (the model is already resident in a measured peak),
    or the RAM the system has free."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_rate(per_second: float) -> str:
    """A rate as people read it: 7.5, 38, 1.2k, 25.0k (a slow CPU run is not "0.0k")."""
    if per_second >= 1000:
        return f"{per_second / 1000:.1f}k"
    return f"{per_second:.1f}" if per_second < 10 else f"{per_second:.0f}"


def fmt_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def preflight_rows(p: Preflight, device: str, extra: dict[str, str]) -> list[tuple[str, str]]:
    """(label, value) rows of the pre-flight screen."""
    rows = [
        ("parameters", f"{fmt_count(p.params)} ({fmt_count(p.params_non_embedding)} without embeddings)"),
        ("corpus tokens", f"{fmt_count(p.train_tokens)} train, {fmt_count(p.val_tokens)} validation"),
        ("tokens per step", f"{p.tokens_per_step:,}"),
    ]
    if p.max_steps is not None:
        rows.append(("steps", f"{p.max_steps:,} (= {p.epochs:.2f} epochs)"))
    if p.max_time is not None:
        rows.append(("time limit", fmt_duration(p.max_time)))
    mem = f"~{fmt_bytes(p.memory_bytes)}"
    if p.available_bytes is not None:
        mem += f" of {fmt_bytes(p.available_bytes)} available"
        if p.memory_bytes > p.available_bytes:
            mem += "  [!] may not fit: lower --batch-size (raise --grad-accum) or --block-size"
    rows.append(("estimated memory" + (" per process" if p.processes > 1 else ""), mem))
    if p.step_seconds is not None:
        rows.append(("step time", f"{p.step_seconds * 1000:.0f} ms (one probe step)"))
    eta = p.eta_seconds
    rows.append(
        ("estimated time", fmt_duration(eta) if eta is not None else "measured after the first steps")
    )
    rows.append(("device", device))
    rows.extend(extra.items())
    return rows


def skeleton(model_config: ModelConfig, cfg: TrainConfig) -> Transformer:
    """The run's model on the meta device (LoRA adapters included), for weights put in later."""
    model = skeletons.skeleton(model_config)
    return lora.add_adapters(model, cfg) if cfg.lora.lora_rank else model


def replica_memory(
    model_config: ModelConfig, cfg: TrainConfig, amp: torch.dtype | None, device: torch.device
) -> tuple[int, int | None]:
    """Bytes one whole replica of the run needs (the pre-flight's estimate, from the model
    built on the meta device) and what one process has (``--parallel auto`` compares them)."""
    if cfg.parallelism.parallel != "auto":
        return 0, None
    need = estimated_memory(skeleton(model_config, cfg), cfg, amp, device, shards=1)
    return need, per_process_memory(available_memory(device), device)


def estimated_memory(
    model: Transformer,
    cfg: TrainConfig,
    amp: torch.dtype | None,
    device: torch.device,
    shards: int,
    context: int | None = None,
    rows: int | None = None,
) -> int:
    """The analytic estimate of a process's bytes (no T×T scores where SDPA's flash kernels run),
    with parameters, gradients and optimizer state split over ``shards`` processes, the
    activations ``--activation-checkpointing`` keeps, ``rows`` sequences a forward (None: a
    micro-batch's, ``--batch-size`` examples of the task's sequences) of ``context`` tokens
    (None: the block size)."""
    flash = device.type == "cuda" and not model.positions.biases_scores and not make_task(cfg).prefix_lm
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = model.num_parameters()
    batch = rows if rows is not None else cfg.optim.batch_size * make_task(cfg).sequences()
    recompute = cfg.parallelism.activation_checkpointing
    return estimate_memory(
        model.config,
        params,
        batch,
        amp is not None,
        flash,
        trainable,
        context,
        shards=shards,
        recompute=recompute,
    )
