"""Preference losses (``--task dpo``): a pair's loss from the log-probabilities of its two replies.

Each pair has a prompt ``x``, a chosen reply ``y_w`` and a rejected one ``y_l``. The losses read
the summed log-probability of each reply's tokens (the reply and its end token, as ``--task sft``
scores them) under the policy being trained, and under the reference (the model as training
started) for the losses that have one:

- ``dpo`` (Rafailov et al. 2023): ``-log sigmoid(beta * h)`` with
  ``h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))``;
- ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, a squared loss that stops pushing once the
  margin reaches its target (DPO's keeps pushing on pairs it already separates);
- ``simpo`` (Meng et al. 2024), reference-free: ``-log sigmoid(beta * (log pi(y_w) / |y_w| -
  log pi(y_l) / |y_l|) - gamma)``, the log-probabilities averaged over each reply's tokens.

What a step logs, per pair then averaged: the implicit rewards ``beta * (log pi - log ref)`` of
each reply (SimPO's: ``beta * log pi / |y|``), their margin, and the accuracy (the fraction of
pairs whose chosen reply has the larger reward). Pure functions of tensors: no model here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.errors import LmcliError

LOSSES = ("dpo", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)  # losses that read no reference model


@dataclass
class PreferenceOut:
    """A batch's loss (a scalar, the mean over pairs) and what a step logs, each (B,) per pair."""

    loss: Tensor
    chosen_reward: Tensor
    rejected_reward: Tensor

    @property
    def margin(self) -> Tensor:
        return self.chosen_reward - self.rejected_reward

    @property
    def accuracy(self) -> Tensor:
        """1.0 where the chosen reply's reward is the larger (ties count as wrong)."""
        return (self.margin > 0).float()

    def logged(self) -> dict[str, float]:
        """The batch means a step reports (host floats: one sync)."""
        values = torch.stack(
            [
                self.loss.detach(),
                *(t.detach().float().mean() for t in (self.chosen_reward, self.rejected_reward)),
            ]
        ).tolist()
        margin, accuracy = self.margin.detach().float().mean().item(), self.accuracy.mean().item()
        return {
            "loss": values[0],
            "reward_chosen": values[1],
            "reward_rejected": values[2],
            "margin": margin,
            "accuracy": accuracy,
        }


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    *,
    loss: str = "dpo",
    beta: float = 0.1,
    gamma: float = 0.5,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PreferenceOut:
    """The mean ``loss`` over B pairs from summed reply log-probs, each (B,).

    ``ref_*``: the reference's (None for a reference-free loss); ``*_tokens`` (B,): the replies'
    lengths in tokens, which SimPO averages over; ``gamma``: SimPO's target margin."""
    if loss not in LOSSES:
        raise LmcliError(f"preference loss {loss!r}: choose from {', '.join(LOSSES)}")
    if loss == "simpo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError(
                "simpo averages over the replies' tokens: pass chosen_tokens and rejected_tokens"
            )
        chosen = beta * policy_chosen / chosen_tokens  # (B,)
        rejected = beta * policy_rejected / rejected_tokens
        losses = -F.logsigmoid(chosen - rejected - gamma)
        return PreferenceOut(losses.mean(), chosen, rejected)
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"{loss} compares with a reference: pass ref_chosen and ref_rejected")
    chosen_ratio = policy_chosen - ref_chosen  # (B,) log pi(y_w) / ref(y_w)
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss == "dpo":
        losses = -F.logsigmoid(beta * h)
    else:  # ipo
        losses = (h - 1 / (2 * beta)) ** 2
    return PreferenceOut(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """The log-probability of each target under its logits: (N, V), (N,) -> (N,) float32.

    Read as a cross-entropy: the (N, V) log-softmax is never kept whole."""
    return -F.cross_entropy(logits.float(), targets, reduction="none")


def row_sums(values: Tensor, rows: Tensor, n_rows: int) -> Tensor:
    """Per-row sums of flat per-token ``values`` (N,) whose row is ``rows`` (N,): (n_rows,)."""
    out = torch.zeros(n_rows, dtype=values.dtype, device=values.device)
    return out.index_add(0, rows, values)
