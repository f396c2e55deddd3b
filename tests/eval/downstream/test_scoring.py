"""Shared-context scoring: each continuation's log-likelihood and greedy flag equal those of one
plain forward over context + continuation, whatever the batch, padding or cut."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_model, tiny_tokenizer

from lmcli.eval.downstream.scoring import Group, encode_pairs, score_groups


def reference(model: torch.nn.Module, group: Group) -> list[tuple[float, bool]]:
    """Each continuation scored alone by one full forward, cut as lm-evaluation-harness cuts a
    pair: the last block + 1 tokens of context + continuation, the last one not an input."""
    block = model.config.block_size
    longest = max(len(c) for c in group.continuations)
    context = group.context[-(block + 1 - longest) :]
    out = []
    for cont in group.continuations:
        ids = torch.tensor([context + cont])
        with torch.no_grad():
            logp = model(ids[:, :-1]).float().log_softmax(-1)[0, -len(cont) :]  # (len(cont), V)
        target = torch.tensor(cont)
        ll = logp.gather(1, target[:, None]).sum().item()
        out.append((ll, bool((logp.argmax(-1) == target).all())))
    return out


def random_groups(rng: random.Random, vocab: int, n: int, max_context: int) -> list[Group]:
    groups = []
    for _ in range(n):
        context = [2] + [rng.randrange(5, vocab) for _ in range(rng.randint(0, max_context))]
        conts = [
            [rng.randrange(5, vocab) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 5))
        ]
        groups.append(Group(context, conts))
    return groups


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_scores_equal_one_forward_per_continuation(position: str) -> None:
    model = tiny_model(position=position, block_size=24)
    groups = random_groups(random.Random(0), model.config.vocab_size, 14, 30)  # some longer than the context
    ours = score_groups(model, groups, batch_size=4)
    for group, scored in zip(groups, ours, strict=True):
        expected = reference(model, group)
        assert [g for _, g in scored] == [g for _, g in expected]
        assert [ll for ll, _ in scored] == pytest.approx([ll for ll, _ in expected], abs=1e-4)


def test_a_greedy_continuation_is_flagged() -> None:
    model = tiny_model()
    context = [2, 7, 8, 9]
    ids = list(context)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    greedy = ids[len(context) :]
    other = [t + 1 if t + 1 < model.config.vocab_size else 5 for t in greedy]
    [scored] = score_groups(model, [Group(context, [greedy, greedy[:1], other])])
    assert [g for _, g in scored] == [True, True, False]


def test_pairs_split_as_the_harness_does() -> None:
    tok = tiny_tokenizer(kind="bpe", vocab_size=300)
    group = encode_pairs(tok, "the cat sat on the ", ["mat.", "log."])
    # the context's trailing space moves to the continuation; <bos> first
    assert group.context == [tok.bos_id, *tok.encode("the cat sat on the")]
    assert group.continuations == [
        tok.encode("the cat sat on the mat.")[len(group.context) - 1 :],
        tok.encode("the cat sat on the log.")[len(group.context) - 1 :],
    ]
    assert tok.decode(group.continuations[0]) == " mat."
