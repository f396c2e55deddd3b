"""GRPO's advantages and clipped objective equal a direct computation from their formulas; a group
whose rewards are all equal contributes no gradient."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lmcli.train.post.policy import group_advantages, policy_loss, spread_fraction

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]]  # (P=3, G=4)


def test_advantages_equal_the_formula() -> None:
    adv = group_advantages(torch.tensor(REWARDS), eps=1e-4)
    for p, group in enumerate(REWARDS):
        mean, std = statistics.mean(group), statistics.stdev(group)  # the sample standard deviation
        expected = [0.0] * 4 if std == 0 else [(r - mean) / (std + 1e-4) for r in group]
        assert adv[p].tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[1].tolist() == [0.0] * 4  # exactly zero, not nearly
    unscaled = group_advantages(torch.tensor(REWARDS), scale=False)
    assert unscaled[2].tolist() == pytest.approx([r - 1.0 for r in REWARDS[2]])
    assert spread_fraction(torch.tensor(REWARDS)) == pytest.approx(2 / 3)


def test_equal_rewards_of_inexact_floats_give_exact_zeros() -> None:
    """0.1 three times has a float mean that is not 0.1: the group still has no spread."""
    adv = group_advantages(torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float32))
    assert adv.tolist() == [[0.0, 0.0, 0.0]]


def _direct(logp, old, adv, ref, clip, clip_high, kl_coef, n):
    total = 0.0
    for lp, o, a, r in zip(logp, old, adv, ref, strict=True):
        ratio = math.exp(lp - o)
        term = -min(ratio * a, min(max(ratio, 1 - clip), 1 + clip_high) * a)
        total += term + kl_coef * (math.exp(r - lp) - (r - lp) - 1)
    return total / n


@pytest.mark.parametrize(("clip_high", "kl_coef"), [(None, 0.0), (0.28, 0.04)])
def test_clipped_objective_equals_the_formula(clip_high: float | None, kl_coef: float) -> None:
    # ratios exp(+0.5), exp(-0.5), 1, exp(0.1), exp(-0.3): clipped above, below, not at all
    logp = [-1.0, -2.5, -0.7, -1.9, -3.3]
    old = [-1.5, -2.0, -0.7, -2.0, -3.0]
    adv = [1.0, -1.0, 0.5, -2.0, 1.5]
    ref = [-1.2, -2.2, -0.9, -1.8, -3.1]
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    out = policy_loss(t(logp), t(old), t(adv), t(ref), clip=0.2, clip_high=clip_high, kl_coef=kl_coef)
    high = 0.2 if clip_high is None else clip_high
    assert out.loss.item() == pytest.approx(_direct(logp, old, adv, ref, 0.2, high, kl_coef, 5), rel=1e-12)
    k3 = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(logp, ref, strict=True)]
    assert out.kl.item() == pytest.approx(sum(k3) / 5, rel=1e-12)
    assert out.clipped.item() == pytest.approx(2 / 5)  # the first two tokens'
    # divided by the whole generation batch's tokens, the loss is the sum's share
    part = policy_loss(
        t(logp), t(old), t(adv), t(ref), clip=0.2, clip_high=clip_high, kl_coef=kl_coef, n_tokens=20
    )
    assert part.loss.item() == pytest.approx(out.loss.item() * 5 / 20, rel=1e-12)


def test_the_gradient_is_the_advantage_where_the_clip_does_not_hold() -> None:
    logp = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -1.5, -0.5], dtype=torch.float64)  # ratios 1, e^0.5 (held), e^-0.5 (held)
    adv = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64)
    policy_loss(logp, old, adv, clip=0.2).loss.backward()
    assert logp.grad.tolist() == pytest.approx([-2.0 / 3, 0.0, 0.0])


def test_a_group_with_equal_rewards_contributes_no_gradient() -> None:
    """Two prompts of two replies each; the second group's rewards are equal: with no KL term
    the weights' gradient is that of the first group alone, and its tokens' gradients are zero."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 6).double()
    x = torch.randn(10, 4, dtype=torch.float64)  # 10 reply tokens
    targets = torch.randint(0, 6, (10,))
    reply = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])  # the reply of each token
    adv = group_advantages(torch.tensor([[1.0, 0.0], [0.3, 0.3]])).view(-1)  # (4,) per reply
    assert adv[2:].tolist() == [0.0, 0.0]

    def grads(keep: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        head.zero_grad()
        logp = torch.log_softmax(head(x), -1)[torch.arange(10), targets]
        logp.retain_grad()
        policy_loss(logp[keep], logp.detach()[keep], adv[reply][keep], n_tokens=10).loss.backward()
        return [p.grad.clone() for p in head.parameters()], logp.grad

    everything, token_grads = grads(torch.ones(10, dtype=torch.bool))
    assert token_grads[5:].abs().max().item() == 0.0 and token_grads[:5].abs().max().item() > 0
    first_group, _ = grads(reply < 2)
    for a, b in zip(everything, first_group, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
