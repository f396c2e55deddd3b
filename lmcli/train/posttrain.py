"""Post-training's model-facing steps: a DPO micro-batch's loss, GRPO's loss over a rollout
group, and their validations (held-out pairs: preference accuracy and margin; held-out prompts:
mean reward and pass@1 of greedy replies).

The formulas are ``preference.py``'s and ``grpo.py``'s; the reference is ``reference.py``'s;
the replies come from ``rollouts.py``. The training loop calls these with the model it trains.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmcli.config import SampleConfig
from lmcli.data.preferences import PairBatch, PromptRow
from lmcli.data.windows import IGNORE
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer
from lmcli.train.grpo import PolicyOut, policy_loss
from lmcli.train.preference import PreferenceOut, preference_loss
from lmcli.train.reference import Reference, evaluating, sequence_logprobs
from lmcli.train.rewards import Rewards
from lmcli.train.rollouts import Group, sample_groups


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
    """The preference loss of a batch of pairs (rows 2i chosen, 2i + 1 rejected)."""
    _, _, sums = sequence_logprobs(model, batch)  # (2B,)
    counts = (batch.y != IGNORE).sum(dim=1).to(sums.dtype)  # (2B,) reply tokens per row
    ref = reference.pair_logprobs(batch, split) if reference.needed else None
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


def group_loss(model: nn.Module, group: Group, *, n_tokens: int, clip: float, kl_coef: float) -> PolicyOut:
    """GRPO's clipped objective over a rollout group's reply tokens (its share of ``n_tokens``)."""
    logp, rows, _ = sequence_logprobs(model, group.batch)  # (N,), (N,)
    advantages = group.advantages.to(logp.device)[rows]  # (N,) each token its reply's
    old = group.old_logp if group.old_logp is not None else logp.detach()
    return policy_loss(logp, old, advantages, group.ref_logp, clip=clip, kl_coef=kl_coef, n_tokens=n_tokens)


@torch.no_grad()
def evaluate_prompts(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[PromptRow],
    rewards: Rewards,
    cfg: SampleConfig,
    rows: int = 64,
) -> dict[str, Any]:
    """Greedy replies to held-out prompts: the mean reward (and each verifier's), and pass@1:
    the share of prompts whose reply earns a positive reward."""
    greedy = SampleConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0, stop=cfg.stop)
    per_verifier = torch.zeros(len(rewards.names), dtype=torch.float64)
    passed = total = 0.0
    for start in range(0, len(prompts), rows):
        part = prompts[start : start + rows]
        replies = sample_groups(model, tokenizer, [p.ids for p in part], 1, greedy)
        for prompt, row in zip(part, replies, strict=True):
            scores = rewards.score(prompt.text, row.text, prompt.row, prompt.where)
            per_verifier += torch.tensor(scores, dtype=torch.float64)
            total += sum(scores)
            passed += sum(scores) > 0
    n = max(len(prompts), 1)
    record = {"val_reward": total / n, "val_pass@1": passed / n}
    if len(rewards.names) > 1:
        means = per_verifier.div(n).tolist()
        record.update({f"val_reward_{name}": v for name, v in zip(rewards.names, means, strict=True)})
    return record
