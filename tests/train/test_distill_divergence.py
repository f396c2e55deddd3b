"""Distillation's divergences equal their formulas computed by hand; the loss over a teacher's
top-K and the mass left (K + 1 buckets) is a lower bound of the full-vocabulary loss, equal to it
when the teacher leaves no mass outside its K tokens, and the forward KL's gap is exactly the
remainder's share of the within-bucket KL; the run's loss mixes its parts as documented. Tokens
drawn from the teacher (sampled logits) estimate the forward KL and its gradient without bias:
draws in the teacher's exact proportions give them exactly, 200,000 random draws within five
standard errors; the estimate is the cross-entropy to the draws' frequencies plus the mean of the
stored log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from lmcli.train.post.divergence import (
    KINDS,
    Targets,
    coarse,
    distill_loss,
    divergence,
    drawn,
    forward_kl,
    jsd,
    renormalized,
    reverse_kl,
    sampled_forward_kl,
    top_k,
)

P = [0.5, 0.25, 0.125, 0.125]  # the teacher's
Q = [0.1, 0.2, 0.3, 0.4]  # the student's


def logs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)


def test_each_divergence_equals_its_formula() -> None:
    student, teacher = logs(Q), logs(P)
    assert forward_kl(student, teacher).item() == pytest.approx(kl(P, Q), rel=1e-12)
    assert reverse_kl(student, teacher).item() == pytest.approx(kl(Q, P), rel=1e-12)
    for beta in (0.1, 0.5, 0.9):
        m = [beta * p + (1 - beta) * q for p, q in zip(P, Q, strict=True)]
        expected = beta * kl(P, m) + (1 - beta) * kl(Q, m)
        assert jsd(student, teacher, beta).item() == pytest.approx(expected, rel=1e-12)
        assert divergence("jsd", student, teacher, beta).item() == pytest.approx(expected, rel=1e-12)
    # the symmetric JSD is at most ln 2, reached by distributions with no common support
    apart = jsd(logs([0.5, 0.5, 0, 0]), logs([0, 0, 0.5, 0.5]), 0.5).item()
    assert apart == pytest.approx(math.log(2), rel=1e-12)
    for kind in KINDS:  # zero between a distribution and itself, rows apart
        assert divergence(kind, logs(P, Q), logs(P, Q)).tolist() == pytest.approx([0.0, 0.0], abs=1e-15)


def test_a_zero_in_the_expected_distribution_adds_nothing_and_no_nan() -> None:
    teacher = logs([0.5, 0.5, 0.0, 0.0])  # log 0 = -inf
    student = logs([0.4, 0.4, 0.1, 0.1]).requires_grad_(True)
    loss = forward_kl(student, teacher)
    assert loss.item() == pytest.approx(kl([0.5, 0.5], [0.4, 0.4]), rel=1e-12)
    loss.backward()
    assert torch.isfinite(student.grad).all()
    assert math.isinf(reverse_kl(student, teacher).item())  # the student's mass where the teacher has none


def full_and_topk(seed: int, V: int = 50, k: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.log_softmax(3 * torch.randn(4, V, generator=g, dtype=torch.float64), -1)
    student = torch.log_softmax(torch.randn(4, V, generator=g, dtype=torch.float64), -1)
    ids, _, _ = top_k(teacher, k)
    return teacher, student, ids


@pytest.mark.parametrize("kind", KINDS)
def test_top_k_and_the_rest_bound_the_full_divergence(kind: str) -> None:
    teacher, student, ids = full_and_topk(0)
    full = divergence(kind, student, teacher)
    buckets = divergence(kind, coarse(student, ids), coarse(teacher, ids))
    assert (buckets <= full + 1e-12).all() and (buckets > 0).all()


def test_the_forward_kl_gap_is_the_rest_times_its_within_bucket_kl() -> None:
    teacher, student, ids = full_and_topk(1)
    rest = torch.ones_like(teacher, dtype=torch.bool).scatter(-1, ids, False)  # (N, V) the other tokens
    p_rest, q_rest = teacher.exp()[rest].view(4, -1), student.exp()[rest].view(4, -1)
    within = [kl((p / p.sum()).tolist(), (q / q.sum()).tolist()) for p, q in zip(p_rest, q_rest, strict=True)]
    gap = forward_kl(student, teacher) - forward_kl(coarse(student, ids), coarse(teacher, ids))
    expected = torch.tensor(within, dtype=torch.float64) * p_rest.sum(-1)
    torch.testing.assert_close(gap, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_no_mass_outside_the_top_k_makes_them_equal(kind: str) -> None:
    teacher, student, _ = full_and_topk(2)
    support = teacher.topk(8, -1).indices
    sharp = torch.full_like(teacher, float("-inf")).scatter(-1, support, teacher.gather(-1, support))
    sharp = renormalized(sharp)  # the teacher gives the other 42 tokens no mass at all
    ids, values, rest = top_k(sharp, 8)
    assert torch.isinf(rest).all()
    stored = Targets(values, ids, rest)
    # the student's mass outside the teacher's support: the rest bucket holds it whole (reverse
    # KL: infinite both ways; jsd: q/m is the same for every token of the bucket)
    torch.testing.assert_close(divergence(kind, *stored.compared(student)), divergence(kind, student, sharp))


@pytest.mark.parametrize("kind", KINDS)
def test_k_equal_to_the_vocabulary_is_the_full_loss_and_its_gradient(kind: str) -> None:
    teacher, student, _ = full_and_topk(3, V=12)
    ids, values, rest = top_k(teacher, 12)
    mine = student.clone().requires_grad_(True)
    theirs = student.clone().requires_grad_(True)
    coarse_loss = divergence(kind, *Targets(values, ids, rest).compared(mine)).sum()
    full_loss = divergence(kind, theirs, teacher).sum()
    torch.testing.assert_close(coarse_loss, full_loss)
    coarse_loss.backward()
    full_loss.backward()
    assert torch.isfinite(mine.grad).all()
    torch.testing.assert_close(mine.grad, theirs.grad)


def test_the_run_loss_mixes_its_parts_as_documented() -> None:
    torch.manual_seed(0)
    V, T = 7, 2.0
    logits = torch.randn(5, V, dtype=torch.float64)  # 3 data positions, then 2 of the student's samples
    targets = torch.tensor([1, 4, 6])
    teacher = torch.log_softmax(torch.randn(5, V, dtype=torch.float64) / T, -1)
    out = distill_loss(
        logits,
        targets,
        Targets(teacher[:3]),
        Targets(teacher[3:]),
        kind="forward_kl",
        temperature=T,
        alpha=0.7,
        fraction=0.25,
    )
    student = torch.log_softmax(logits / T, -1).tolist()
    p = [[math.exp(v) for v in row] for row in teacher.tolist()]
    q = [[math.exp(v) for v in row] for row in student]
    data_kl = sum(kl(p[i], q[i]) for i in range(3)) / 3
    ce = -sum(torch.log_softmax(logits[i], -1)[t].item() for i, t in enumerate(targets.tolist())) / 3
    own = sum(kl(q[i], p[i]) for i in (3, 4)) / 2
    expected = 0.75 * (0.7 * T * T * data_kl + 0.3 * ce) + 0.25 * T * T * own
    # (the loss computes in float32, as under autocast)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.kl.item() == pytest.approx(data_kl, rel=1e-6) and out.ce.item() == pytest.approx(ce, rel=1e-6)
    assert out.on_policy_kl.item() == pytest.approx(own, rel=1e-6)


def test_stored_sixteen_bit_buckets_are_renormalized() -> None:
    teacher, student, ids = full_and_topk(4)
    exact = coarse(teacher, ids)
    stored = Targets(exact[:, :-1].half().float(), ids, exact[:, -1].half().float())
    _, theirs = stored.compared(student.float())
    assert theirs.exp().sum(-1).tolist() == pytest.approx([1.0] * 4, abs=1e-6)
    torch.testing.assert_close(theirs.double(), exact, rtol=0, atol=2e-3)  # float16's step at these values


def test_draws_in_the_teachers_proportions_give_the_forward_kl_and_its_gradient_exactly() -> None:
    teacher = logs(P)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 3]])  # the multiset whose frequencies are P (eighths)
    mine = logs(Q).requires_grad_(True)
    theirs = logs(Q).requires_grad_(True)
    estimate = sampled_forward_kl(mine, ids, teacher.gather(-1, ids))
    full = forward_kl(theirs, teacher)
    assert estimate.item() == pytest.approx(kl(P, Q), rel=1e-12)
    estimate.sum().backward()
    full.sum().backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-15)


def test_many_draws_follow_the_teacher_and_estimate_the_forward_kl_and_its_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    V, n = 50, 200_000
    teacher = torch.log_softmax(2 * torch.randn(1, V, generator=g, dtype=torch.float64), -1)
    teacher[0, [3, 17, 49]] = float("-inf")  # tokens without mass (the last one too)
    teacher = teacher - teacher.logsumexp(-1, keepdim=True)
    logits = torch.randn(1, V, generator=g, dtype=torch.float64)
    ids, logp = drawn(teacher, n, torch.Generator().manual_seed(1))
    assert ids.shape == (1, n) and torch.equal(logp, teacher.gather(-1, ids))
    p = teacher.exp()[0]
    freq = torch.bincount(ids[0], minlength=V).double() / n
    assert freq[[3, 17, 49]].tolist() == [0.0, 0.0, 0.0]  # never drawn
    five_errors = 5 * (p * (1 - p) / n).sqrt() + 1e-12  # per token, five standard errors
    assert ((freq - p).abs() <= five_errors).all()
    # the estimate: within five standard errors of its mean, the full forward KL
    mine = logits.clone().requires_grad_(True)
    theirs = logits.clone().requires_grad_(True)
    terms = logp - torch.log_softmax(mine, -1).gather(-1, ids)  # (1, n)
    estimate = terms.mean(-1)
    full = forward_kl(torch.log_softmax(theirs, -1), teacher)
    assert abs(estimate.item() - full.item()) <= 5 * terms.std().item() / math.sqrt(n)
    assert estimate.item() == pytest.approx(
        sampled_forward_kl(torch.log_softmax(logits, -1), ids, logp).item()
    )
    # its gradient in the logits is q - freq, the full one's q - p: within the same bound
    estimate.sum().backward()
    full.sum().backward()
    assert ((mine.grad - theirs.grad)[0].abs() <= five_errors).all()


def test_draws_of_several_rows_follow_each_rows_own_distribution() -> None:
    rows = logs([0, 0, 1.0, 0], [0.5, 0, 0, 0.5], [0, 1.0, 0, 0])
    ids, logp = drawn(rows, 1000, torch.Generator().manual_seed(2))
    assert set(ids[0].tolist()) == {2} and set(ids[2].tolist()) == {1} and set(ids[1].tolist()) == {0, 3}
    assert logp[0].tolist() == [0.0] * 1000 and torch.isfinite(logp).all()
    again, _ = drawn(rows, 1000, torch.Generator().manual_seed(2))
    assert torch.equal(ids, again)  # the same generator's seed, the same draws


def test_the_sampled_estimate_is_the_cross_entropy_to_the_draws_plus_their_log_probs() -> None:
    """Through the run's loss, at a temperature: ``kl`` is, row by row, the cross-entropy of the
    student's softened distribution to the draws' frequencies plus the mean stored log-prob (any
    values: the student's gradient does not depend on them), scaled by T^2 in the loss."""
    g = torch.Generator().manual_seed(5)
    N, V, K, T = 6, 11, 9, 2.0
    logits = torch.randn(N, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (N, K), generator=g)
    stored = -3 * torch.rand(N, K, generator=g, dtype=torch.float64)
    out = distill_loss(
        logits, torch.zeros(N, dtype=torch.long), Targets(stored, ids, drawn=True), temperature=T
    )
    q = torch.log_softmax(logits / T, -1)
    expected = 0.0
    for i in range(N):
        freq = torch.bincount(ids[i], minlength=V).double() / K
        expected += (-(freq * q[i]).sum() + stored[i].mean()).item() / N
    assert out.kl.item() == pytest.approx(expected, rel=1e-6)
    assert out.loss.item() == pytest.approx(T * T * expected, rel=1e-6)
    for kind in ("reverse_kl", "jsd"):  # expectations under the student: draws of the teacher cannot say
        with pytest.raises(ValueError, match=f"{kind} cannot be estimated from tokens drawn"):
            distill_loss(
                logits, torch.zeros(N, dtype=torch.long), Targets(stored, ids, drawn=True), kind=kind
            )
