"""GRPO's objective (``--task grpo``): group-normalized advantages and the clipped policy loss.

For each prompt the model samples G replies (a group); each reply gets a reward. A reply's
advantage is its reward against its group's: ``(r - mean(r)) / (std(r) + eps)`` (Shao et al.
2024, DeepSeekMath), so no value model is needed. A group whose rewards are all equal tells
nothing about which reply is better: its advantages are exactly zero, and with no KL term its
replies contribute no gradient.

Every token of a reply carries its reply's advantage ``A``. With ``ratio = pi(token) /
pi_old(token)`` (``pi_old``: the policy that sampled the replies; the ratio is 1 on the first
optimizer step of a generation batch) the loss of a token is PPO's clipped objective

    -min(ratio * A, clip(ratio, 1 - clip, 1 + clip_high) * A) + kl_coef * k3

with ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased, non-negative estimator of
KL(pi || ref), ``ref`` the reference's log-prob of the token). The batch's loss is the mean over
all reply tokens (token-level, as DAPO and Dr. GRPO do: a long reply weighs by its tokens, not
as one sequence). Tokens are flat: (N,) tensors of the scored positions of a batch, in the order
``evaluate.forward_scored`` reads them, and ``rows`` (N,) names the reply of each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-4, scale: bool = True) -> Tensor:
    """Advantages (P, G) of rewards (P, G): P prompts, G replies each; a group without spread
    gets zeros. ``scale``: divide by the group's standard deviation (Dr. GRPO leaves it out)."""
    if rewards.size(1) < 2:
        raise ValueError("a group needs at least two replies to compare")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (P, G)
    if scale:
        centered = centered / (rewards.std(dim=1, keepdim=True) + eps)
    spread = (rewards.amax(dim=1) > rewards.amin(dim=1)).unsqueeze(1)  # (P, 1)
    return torch.where(spread, centered, torch.zeros_like(centered))


def spread_fraction(rewards: Tensor) -> float:
    """The fraction of groups (rows of (P, G)) whose rewards are not all equal."""
    return (rewards.amax(dim=1) > rewards.amin(dim=1)).float().mean().item()


@dataclass
class PolicyOut:
    """A batch's loss (scalar) and what a step logs about it (scalars, detached)."""

    loss: Tensor
    kl: Tensor  # mean k3 over the tokens (0 without a reference)
    clipped: Tensor  # the fraction of tokens whose ratio the clip held
    ratio: Tensor  # the mean ratio pi / pi_old


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    ref_logp: Tensor | None = None,
    *,
    clip: float = 0.2,
    clip_high: float | None = None,
    kl_coef: float = 0.0,
    n_tokens: int | None = None,
) -> PolicyOut:
    """The clipped objective over N reply tokens, each (N,): the policy's log-probs (with
    gradient), the sampling policy's, the token's advantage (its reply's), the reference's.

    ``n_tokens``: what the summed loss is divided by (default N; the whole generation batch's
    token count when a batch is split into micro-batches, so their gradients add up to the mean)."""
    clip_high = clip if clip_high is None else clip_high
    old_logp, advantages = old_logp.detach(), advantages.detach()
    ratio = torch.exp(logp - old_logp)  # (N,)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # (N,)
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None:
        diff = ref_logp.detach() - logp  # (N,) log ref / pi
        k3 = torch.exp(diff) - diff - 1
        if kl_coef:
            per_token = per_token + kl_coef * k3
        kl = k3.detach().mean()
    denominator = logp.numel() if n_tokens is None else n_tokens
    held = (clipped < unclipped).float().mean()  # the clip chose the smaller value: no gradient there
    return PolicyOut(per_token.sum() / max(denominator, 1), kl, held.detach(), ratio.detach().mean())
