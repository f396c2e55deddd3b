"""``--task dpo``: preference tuning, one method object (``DPO``) and its config section's options
(``PostTrainConfig``: ``--beta``, ``--preference-loss``, ``--simpo-gamma``,
``--precompute-reference``).

A micro-batch is a batch of pairs (rows 2i chosen, 2i + 1 rejected); its loss is the preference
loss of ``preference.py`` (DPO, IPO or SimPO) of the policy's and the reference's summed reply
log-probs. A validation scores held-out pairs: the loss (what ``best/`` follows), preference
accuracy, margin and rewards. ``score_preferences`` is ``lmcli eval --preferences``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmcli.config.train import TrainConfig
from lmcli.data.examples import ExampleSet
from lmcli.data.preferences import (
    PairBatch,
    PreferenceData,
    PreferenceRows,
    PromptData,
    collate_pairs,
    pair_set,
)
from lmcli.data.train_data import TrainData
from lmcli.data.windows import IGNORE
from lmcli.device import autocast
from lmcli.formats.checkpoint import Checkpoint
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer
from lmcli.train.post.base import PostMethod
from lmcli.train.post.preference import PreferenceOut, preference_loss
from lmcli.train.post.reference import Reference, evaluating, make_reference, sequence_logprobs
from lmcli.train.run import Run, sampler_batches
from lmcli.train.state import Stateful


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference loss reads besides log-probs: its name, beta, SimPO's gamma."""

    loss: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5


def pair_loss(
    model: nn.Module,
    batch: PairBatch,
    reference: Reference,
    settings: PreferenceSettings,
    split: str = "train",
) -> PreferenceOut:
    """The preference loss of a batch of pairs (rows 2i chosen, 2i + 1 rejected); without a
    reference (``lmcli eval --preferences`` alone) DPO's rewards are the policy's own log-probs."""
    _, _, sums = sequence_logprobs(model, batch)  # (2B,)
    counts = (batch.y != IGNORE).sum(dim=1).to(sums.dtype)  # (2B,) reply tokens per row
    if reference.needed:
        ref = reference.pair_logprobs(batch, split)
    else:  # reference-free: SimPO reads none; the others compare the policy's own log-probs
        ref = None if settings.loss == "simpo" else torch.zeros_like(sums)
    return preference_loss(
        sums[0::2],
        sums[1::2],
        None if ref is None else ref[0::2],
        None if ref is None else ref[1::2],
        loss=settings.loss,
        beta=settings.beta,
        gamma=settings.gamma,
        chosen_tokens=counts[0::2],
        rejected_tokens=counts[1::2],
    )


@torch.no_grad()
def evaluate_pairs(
    model: nn.Module,
    batches: Iterable[PairBatch],
    reference: Reference,
    settings: PreferenceSettings,
    split: str = "val",
) -> dict[str, float]:
    """Mean loss, rewards, margin and preference accuracy over the pairs of ``batches``."""
    totals: dict[str, float] = {}
    n = 0
    with evaluating(model):
        for batch in batches:
            out = pair_loss(model, batch, reference, settings, split)
            size = out.margin.numel()
            for key, value in out.logged().items():
                totals[key] = totals.get(key, 0.0) + value * size
            n += size
    return {key: value / max(n, 1) for key, value in totals.items()} | {"pairs": n}


def score_preferences(
    model: nn.Module,
    tokenizer: Tokenizer,
    spec: str,
    reference: nn.Module | None = None,
    batch_size: int = 16,
) -> dict[str, float]:
    """``lmcli eval MODEL --preferences FILE [--reference REF]``: preference accuracy (the share of
    pairs whose chosen reply the model prefers) and mean margin in nats: of the model's own
    log-probs, or with ``reference`` of its log-ratios to the reference's (DPO's implicit reward)."""
    device = next(model.parameters()).device
    block = model.config.block_size
    sequences = pair_set(PreferenceRows(spec).pairs(tokenizer, block + 1))
    n = len(sequences) // 2
    batches = (
        collate_pairs(sequences, range(i, min(i + batch_size, n)), tokenizer.pad_id, block).to(device)
        for i in range(0, n, batch_size)
    )
    ref = Reference("copy", reference) if reference is not None else Reference("none")
    scores = evaluate_pairs(model, batches, ref, PreferenceSettings("dpo", beta=1.0))
    return {"accuracy": scores["accuracy"], "margin": scores["margin"], "pairs": scores["pairs"]}


class DPO(PostMethod[PairBatch]):
    """``--task dpo``: the preference loss of each micro-batch of pairs (``pair_loss``); validation
    on held-out pairs. With ``--precompute-reference`` the reference's log-probs are a table
    computed before the first step (``begin``) and saved with the trainer state (``parts``)."""

    shown = (("margin", "margin", ".3f"), ("accuracy", "acc", ".2f"))

    def __init__(
        self, reference: Reference, settings: PreferenceSettings, data: PreferenceData, cfg: TrainConfig
    ):
        super().__init__(reference)
        self.settings, self.data, self.cfg = settings, data, cfg

    @classmethod
    def open(
        cls, cfg: TrainConfig, model: Transformer, resumed: Checkpoint | None, data: TrainData | PromptData
    ) -> DPO:
        """The method of a run: its settings, its reference (a table, the LoRA base or a copy)."""
        assert isinstance(data, PreferenceData)
        post = cfg.post
        settings = PreferenceSettings(post.preference_loss, post.beta, post.simpo_gamma)
        if post.precompute_reference:
            reference = Reference("table")
        else:
            reference = make_reference(cfg, model, resumed, post.preference_loss != "simpo")
        return cls(reference, settings, data, cfg)

    def micro_batches(self, run: Run) -> Iterator[PairBatch]:
        return sampler_batches(run)

    def loss(self, model: nn.Module, micro: PairBatch) -> torch.Tensor:
        out = pair_loss(model, micro, self.reference, self.settings)
        self.add({k: v for k, v in out.logged().items() if k != "loss"})
        return out.loss / self.cfg.optim.grad_accum

    def validate(self, run: Run) -> tuple[float, dict[str, float]]:
        """The validation loss (what ``best/`` follows) and the record: accuracy, margin, rewards,
        of the first ``--eval-batches`` batches of held-out pairs."""
        size = self.cfg.optim.batch_size
        batches = (
            b.to(run.device) for b in self.data.val_batches(size, self.cfg.validation.eval_batches * size)
        )
        with autocast(run.device, run.amp):
            scores = evaluate_pairs(run.model, batches, self.reference, self.settings)
        record = {f"val_{k}": v for k, v in scores.items() if k != "pairs"}
        return scores["loss"], record

    def summary(self, record: dict[str, Any]) -> str:
        return (
            f"val loss {record['val_loss']:.4f}, accuracy {record['val_accuracy']:.3f}, "
            f"margin {record['val_margin']:.4f}"
        )

    def parts(self) -> dict[str, Stateful]:
        return {"reference": self.reference} if self.reference.kind == "table" else {}

    def begin(self, run: Run, fresh: bool) -> None:
        """``--precompute-reference``: each pair's reference log-probs (training and validation
        pairs), computed once with the model as training starts (a resumed run read them back
        with its state)."""
        if self.reference.kind != "table" or not fresh:
            return
        size, data = self.cfg.optim.batch_size, self.data
        for split, sequences in (("train", data.train), ("val", data.val)):
            with autocast(run.device, run.amp):
                self.reference.fill_table(
                    run.model, split, pair_batches(data, sequences, size, run), len(sequences) // 2
                )

    def context(self, run: Run) -> int | None:
        return self.data.longest_example()

    def describe(self) -> dict[str, str]:
        s = self.settings
        return {"post-training": f"{s.loss.upper()}, beta {s.beta:g}; {self.reference_words()}"}


def pair_batches(data: PreferenceData, sequences: ExampleSet, size: int, run: Run) -> Iterator[PairBatch]:
    """Every pair of ``sequences`` in order, ``size`` pairs a batch, on the run's device."""
    n = len(sequences) // 2
    for i in range(0, n, size):
        batch = collate_pairs(sequences, range(i, min(i + size, n)), data.tokenizer.pad_id, data.block_size)
        yield batch.to(run.device)
