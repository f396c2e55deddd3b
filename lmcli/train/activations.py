"""Activation checkpointing (``--activation-checkpointing``): each Transformer block recomputes
what it does not keep for the backward, through ``torch.utils.checkpoint``.

- ``full``: a block keeps its input only; the backward runs its forward again (one block's
  activations alive at a time).
- ``selective``: a block keeps the outputs of its matrix products (the linear layers) and of
  the fused attention kernel, and recomputes the cheap ops between them — norms, the MLP's
  nonlinearity, residual sums, dropout (its random mask replayed), the rotary rotation — with
  ``create_selective_checkpoint_contexts``. Where attention runs on the unfused path (a mask,
  ALiBi), its T×T scores are batched products (``bmm``) and are recomputed, not kept.

The wrapping is applied from the training side: each block's ``forward`` is replaced on the
instance, so the module tree and every parameter name stay those of ``lmcli.model.transformer`` (a
``checkpoint_wrapper`` module would add a level to every name). The results are those of the
plain forward: recomputation replays the same ops on the same inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lmcli.model.transformer import Transformer

aten = torch.ops.aten
# ops whose outputs ``selective`` keeps: the linear layers' products and fused attention kernels
KEPT_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def _recomputed(forward: Callable[..., torch.Tensor], selective: bool, *args: Any) -> torch.Tensor:
    if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
        return forward(*args)
    if selective:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts)
    return checkpoint(forward, *args, use_reentrant=False)


def checkpoint_blocks(model: Transformer, mode: str) -> None:
    """Make every block of ``model`` recompute its activations in the backward (``mode``:
    ``full`` or ``selective``; ``none`` leaves the model as it is)."""
    if mode == "none":
        return
    for block in model.h:
        block.forward = functools.partial(_recomputed, block.forward, mode == "selective")
