"""Distillation's divergences equal their formulas computed by hand; the loss over a teacher's
top-K and the mass left (K + 1 buckets) is a lower bound of the full-vocabulary loss, equal to it
when the teacher leaves no mass outside its K tokens, and the forward KL's gap is exactly the
remainder's share of the within-bucket KL; the run's loss mixes its parts as documented."""

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
    forward_kl,
    jsd,
    renormalized,
    reverse_kl,
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
