"""The reference of post-training: the model as training starts, frozen.

DPO's loss and GRPO's KL term compare the policy's log-probabilities with the reference's. Which
reference a run keeps (``make_reference``):

- ``adapters``: a LoRA run's base model is the reference: the trained model itself with its
  adapters switched off (``adapters_off``), no second copy in memory;
- ``copy``: full fine-tuning keeps one frozen copy of the starting weights (on resume it is read
  again from ``--init-from``);
- ``table``: with ``--precompute-reference`` (DPO), each pair's two summed log-probs are computed
  once before the first step and kept in the trainer state (a resume reads them back), so no
  reference model stays in memory;
- ``none``: a reference-free loss (SimPO), or GRPO without a KL term.

Every reference forward runs without gradients and without dropout.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lmcli.data.preferences import PairBatch
from lmcli.data.windows import Batch
from lmcli.eval.perplexity import forward_scored
from lmcli.model.lora import LoRALinear
from lmcli.model.transformer import Transformer
from lmcli.train.post.preference import row_sums, token_logprobs

if TYPE_CHECKING:
    from lmcli.config.train import TrainConfig
    from lmcli.formats.checkpoint import Checkpoint

KINDS = ("adapters", "copy", "table", "none")


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing its base's output: every LoRA adapter's update scaled by zero (exactly
    the base's: ``x + 0.0 == x``), restored afterwards."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    scales = [m.scale for m in layers]
    for m in layers:
        m.scale = 0.0
    try:
        yield model
    finally:
        for m, scale in zip(layers, scales, strict=True):
            m.scale = scale


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) for the block, its mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def sequence_logprobs(model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token log-probs (N,) of a batch's scored targets, each token's row (N,), and per-row
    sums (B,): the log-probability of each row's reply."""
    logits, targets = forward_scored(model, batch)  # (N, V), (N,)
    per_token = token_logprobs(logits, targets)
    rows = batch.index // batch.x.size(1)  # (N,) flat position -> row
    return per_token, rows, row_sums(per_token, rows, batch.x.size(0))


class Reference:
    """The starting model's log-probs, as one of ``KINDS`` keeps them (see the module docstring).

    ``model`` is the model being trained (``adapters``) or the frozen copy (``copy``); ``tables``
    (``table``) map a split (``"train"``, ``"val"``) to its pairs' (P, 2) summed log-probs."""

    def __init__(self, kind: str, model: nn.Module | None = None) -> None:
        assert kind in KINDS
        self.kind, self.model = kind, model
        self.tables: dict[str, Tensor] = {}

    @property
    def needed(self) -> bool:
        return self.kind != "none"

    @property
    def nbytes(self) -> int:
        """Memory it holds beside the model being trained: a frozen copy's weights, a table."""
        held = list(self.model.parameters()) if self.kind == "copy" and self.model is not None else []
        return sum(t.numel() * t.element_size() for t in [*held, *self.tables.values()])

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[nn.Module]:
        assert self.model is not None, f"a {self.kind} reference runs no model"
        with torch.no_grad(), evaluating(self.model):
            if self.kind == "adapters":
                with adapters_off(self.model):
                    yield self.model
            else:
                yield self.model

    def token_logprobs(self, batch: Batch) -> Tensor:
        """The reference's log-prob of every scored token of ``batch`` (N,)."""
        with self._frozen() as model:
            return sequence_logprobs(model, batch)[0]

    def pair_logprobs(self, batch: PairBatch, split: str = "train") -> Tensor:
        """The reference's summed reply log-probs of a batch of pairs, (2B,) interleaved as the
        batch's rows (chosen, rejected, chosen, ...)."""
        if self.kind == "table":
            table = self.tables[split]  # (P, 2)
            assert batch.pairs is not None
            return table[batch.pairs.to(table.device)].reshape(-1).to(batch.x.device)  # (B, 2) -> (2B,)
        with self._frozen() as model:
            return sequence_logprobs(model, batch)[2]

    def fill_table(self, model: nn.Module, split: str, batches: Iterator[PairBatch], n_pairs: int) -> None:
        """Compute a split's table once, with ``model`` as it stands (before training)."""
        table = torch.zeros(n_pairs, 2, dtype=torch.float32)
        with torch.no_grad(), evaluating(model):
            for batch in batches:
                sums = sequence_logprobs(model, batch)[2].float().cpu()  # (2B,)
                table[batch.pairs] = sums.view(-1, 2)  # (2B,) -> (B, 2)
        self.tables[split] = table

    # a Stateful part of the trainer state: the tables (the other kinds keep nothing)
    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.tables)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.tables = {split: t.float() for split, t in state.items()}


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that never trains."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def make_reference(
    cfg: TrainConfig, model: Transformer, resumed: Checkpoint | None, needed: bool
) -> Reference:
    """The model as training starts: with LoRA the base (adapters off); else a frozen copy, of
    the model now or, on resume, of ``--init-from`` read again (also with LoRA when the embedding
    trains too: ``--lora-train-embeddings`` changes the base)."""
    if not needed:
        return Reference("none")
    if cfg.lora.lora_rank and not cfg.lora.lora_train_embeddings:
        return Reference("adapters", model)
    if resumed is None:
        return Reference("copy", frozen_copy(model))
    from lmcli.train.init_from import open_init

    assert cfg.init_from is not None  # a post-training task needs it (tasks.PostTraining.check)
    start = open_init(cfg.init_from, lambda msg: None, model.config.block_size).load(False)[0]
    device = next(model.parameters()).device
    return Reference("copy", frozen_copy(start).to(device))
