"""Distillation's divergences, pure functions of log-probabilities: how far a student's next-token
distribution is from its teacher's, one number a position.

Each takes the two distributions over the same buckets as log-probs, (N, B): the whole
vocabulary (B = V, a teacher run beside the student), or the K tokens the teacher found most
likely plus one bucket for the rest (B = K + 1, logits read from shards: ``coarse``). Sampled
logits (K tokens drawn from the teacher) estimate the forward KL instead (``sampled_forward_kl``).

- ``forward_kl``: KL(teacher || student) = sum_v p(v) (log p(v) - log q(v)): the student is
  pulled to cover every token the teacher gives mass to (Hinton et al. 2015);
- ``reverse_kl``: KL(student || teacher) = sum_v q(v) (log q(v) - log p(v)): the student is
  pulled towards the teacher's modes and away from what the teacher finds unlikely (GKD's
  on-policy setting, MiniLLM);
- ``jsd``: the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024) with weight
  beta: ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``; bounded by
  ln 2 at beta 0.5, the symmetric JSD.

A bucket where the distribution whose expectation is taken has no mass adds nothing (0 log 0 =
0), so a teacher's ``-inf`` (a remainder of exactly zero) is read as the limit, never as nan.

``coarse`` explains the offline loss: the divergence of the (K+1)-bucket distributions is a
lower bound of the full one (every f-divergence shrinks when buckets are merged), and equal to
it when the teacher's remainder is zero. For the forward KL exactly:
``KL(p || q) = KL(p_K+1 || q_K+1) + p(rest) KL(p(. | rest) || q(. | rest))``: what the teacher
leaves outside its top K, the student learns nothing of token by token.

``sampled_forward_kl`` has no such gap: the mean over K tokens drawn from the teacher of ``log
p(v) - log q(v)`` is an unbiased estimate of KL(p || q), and its gradient (``-mean grad log
q(v)``) of the full one's (Anshumann et al. 2025, "Sparse Logit Sampling"); its noise shrinks as
1 / K. The reverse KL and the JSD are expectations under the student, not the teacher: draws of
the teacher do not estimate them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("forward_kl", "reverse_kl", "jsd")


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) of each row (N,): sum_b p(b) (log p(b) - log q(b)), 0 where p(b) is 0 (the
    logs masked there first: no ``0 * inf`` in the forward, no nan in the backward)."""
    p = logp.exp()
    held = p > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return (p * (torch.where(held, logp, zero) - torch.where(held, logq, zero))).sum(dim=-1)


def forward_kl(student: Tensor, teacher: Tensor) -> Tensor:
    """KL(teacher || student) of each row (N,), from log-probs (N, B)."""
    return _kl(teacher, student)


def reverse_kl(student: Tensor, teacher: Tensor) -> Tensor:
    """KL(student || teacher) of each row (N,), from log-probs (N, B)."""
    return _kl(student, teacher)


def jsd(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """The generalized Jensen-Shannon divergence of each row (N,) with the teacher's weight
    ``beta`` (0 < beta < 1): ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 -
    beta) q``, ``p`` the teacher's, ``q`` the student's distribution."""
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))  # (N, B)
    return beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)


def divergence(kind: str, student: Tensor, teacher: Tensor, beta: float = 0.5) -> Tensor:
    """The divergence ``kind`` (``KINDS``) of each row (N,), from log-probs (N, B)."""
    if kind == "forward_kl":
        return forward_kl(student, teacher)
    if kind == "reverse_kl":
        return reverse_kl(student, teacher)
    return jsd(student, teacher, beta)


def rest_logprob(logp: Tensor, ids: Tensor) -> Tensor:
    """The log of the mass a distribution (log-probs (N, V)) puts outside the ids (N, K) of each
    row (N,): the log-sum-exp of the other tokens' log-probs, exact however small it is
    (``-inf`` when the ids hold every token)."""
    if ids.size(-1) == logp.size(-1):  # nothing left (and no nan from a log-sum-exp of nothing)
        return torch.full(logp.shape[:-1], float("-inf"), dtype=logp.dtype, device=logp.device)
    return logp.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)


def coarse(logp: Tensor, ids: Tensor) -> Tensor:
    """A distribution (log-probs (N, V)) as K + 1 buckets (N, K+1): the tokens ``ids`` (N, K),
    then the rest."""
    return torch.cat([logp.gather(-1, ids), rest_logprob(logp, ids).unsqueeze(-1)], dim=-1)


def top_k(logp: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``k`` most likely tokens of each row of log-probs (N, V), taken after the full
    softmax: their ids (N, k), their log-probs (N, k) and the log of the mass left (N,)."""
    values, ids = logp.topk(k, dim=-1)
    return ids, values, rest_logprob(logp, ids)


def drawn(logp: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``k`` tokens of each row of log-probs (N, V) drawn with replacement from its distribution
    (in order of drawing): their ids (N, k) and log-probs (N, k). The uniforms come from
    ``generator`` on the CPU (the same on any device) and are inverted through the cumulative
    distribution: a token without mass is never drawn."""
    u = torch.rand(logp.size(0), k, generator=generator).to(logp.device)  # (N, k) in [0, 1)
    cdf = logp.exp().cumsum(dim=-1)  # (N, V)
    total = cdf[:, -1:]
    ids = torch.searchsorted(cdf, u * total, right=True)  # the first token whose cdf passes u * total
    last = (cdf < total).sum(dim=-1, keepdim=True)  # the last token with mass (where u * total rounds up)
    ids = torch.minimum(ids, last)
    return ids, logp.gather(-1, ids)


def sampled_forward_kl(student: Tensor, ids: Tensor, logp: Tensor) -> Tensor:
    """The estimate of KL(teacher || student) of each row (N,) from K tokens ``ids`` (N, K) drawn
    from the teacher and the teacher's log-probs of them (N, K): the mean over the draws of
    ``log p(v) - log q(v)``, ``student`` the student's log-probs (N, V). Unbiased, and so is
    its gradient; a row's estimate may be below 0."""
    return (logp - student.gather(-1, ids)).mean(dim=-1)


def renormalized(buckets: Tensor) -> Tensor:
    """Log-probs (N, B) shifted to sum to one: stored ones rounded to 16 bits sum to one only
    within their rounding."""
    return buckets - buckets.logsumexp(dim=-1, keepdim=True)


@dataclass
class Targets:
    """The teacher's side of a batch's scored positions (N of them), at the run's temperature:
    log-probs over the vocabulary (N, V) (a teacher run beside the student), or (read from
    logit shards) the ids (N, K) of its K most likely tokens, their log-probs (N, K) and the
    log of the mass left (N,), or (``drawn``: sampled logits) the ids (N, K) of K tokens drawn
    from it and their log-probs (N, K)."""

    logp: Tensor
    ids: Tensor | None = None
    rest: Tensor | None = None
    drawn: bool = False

    def divergence(self, kind: str, student: Tensor, beta: float = 0.5) -> Tensor:
        """The divergence ``kind`` of each row (N,) from the student's log-probs (N, V): over
        the vocabulary, the K + 1 buckets, or estimated from the draws (the forward KL only)."""
        if not self.drawn:
            return divergence(kind, *self.compared(student), beta)
        if kind != "forward_kl":
            raise ValueError(f"{kind} cannot be estimated from tokens drawn from the teacher")
        assert self.ids is not None
        return sampled_forward_kl(student, self.ids, self.logp)

    def compared(self, student: Tensor) -> tuple[Tensor, Tensor]:
        """The student's and the teacher's log-probs over the same buckets, (N, B) each: the
        vocabulary, or the teacher's K tokens and the rest (the teacher's renormalized)."""
        if self.ids is None:
            return student, self.logp
        assert self.rest is not None
        teacher = renormalized(torch.cat([self.logp, self.rest.unsqueeze(-1)], dim=-1))
        return coarse(student, self.ids), teacher


@dataclass
class DistillOut:
    """A micro-batch's distillation loss and its parts (means over their positions)."""

    loss: Tensor  # what the backward runs on
    kl: Tensor  # the divergence of the data's positions (at the temperature, not scaled)
    ce: Tensor  # the data's cross-entropy
    on_policy_kl: Tensor | None  # the reverse KL of the student's own samples


def distill_loss(
    logits: Tensor,
    targets: Tensor,
    teacher: Targets | None,
    sampled: Targets | None = None,
    *,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    alpha: float = 1.0,
    fraction: float = 0.0,
) -> DistillOut:
    """The loss of ``N = N_d + N_s`` scored positions: the student's logits (N, V) and the data's
    next tokens (N_d,) of the first ``N_d`` (the data's positions, ``teacher``'s N), the student's
    own samples after them (``sampled``'s N_s, full distributions).

    The data's positions: ``alpha * T^2 * D(student, teacher) + (1 - alpha) * CE``, D the
    divergence ``kind`` of the two distributions softened by ``T = temperature`` (the square
    keeps the gradient's size as T changes, as Hinton et al. scale it); the samples':
    ``T^2 * reverse KL``. Each part is a mean over its positions; they are weighed ``1 -
    fraction`` and ``fraction`` (the share of the batch's rows the student sampled)."""
    n_data = targets.numel()
    data, own = logits[:n_data].float(), logits[n_data:].float()
    scale = temperature * temperature
    zero = logits.new_zeros((), dtype=torch.float32)
    kl = ce = loss = zero
    if n_data:
        assert teacher is not None
        student = torch.log_softmax(data / temperature, dim=-1)
        kl = teacher.divergence(kind, student, beta).mean()
        ce = torch.nn.functional.cross_entropy(data, targets)
        loss = alpha * scale * kl + (1 - alpha) * ce
    on_policy = None
    if sampled is not None:
        on_policy = reverse_kl(torch.log_softmax(own / temperature, dim=-1), sampled.logp).mean()
        loss = (1 - fraction) * loss + fraction * scale * on_policy
    return DistillOut(loss, kl.detach(), ce.detach(), None if on_policy is None else on_policy.detach())
