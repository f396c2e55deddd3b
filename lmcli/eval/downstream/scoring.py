"""Log-likelihoods of continuations, each context run once however many continuations follow it.

A ``Group`` is a context and the continuations scored after it (a question and its choices, a
cloze text and its target, a harness request's context and every continuation asked of it). A
batch of groups goes through the model in two forwards: the contexts, left-padded, fill a KV
cache and give the log-probabilities of each continuation's first token; the cache's rows are
then repeated, one per continuation, and the continuations (right-padded) run on top of their
context's keys and values, the vocabulary projection computed only where a continuation token is
predicted. For each continuation: the sum of its tokens' log-probabilities and whether greedy
decoding would have produced it (every token the argmax), lm-evaluation-harness's
``(loglikelihood, is_greedy)``.

Tokenization follows lm-evaluation-harness's ``_encode_pair``: a context's trailing spaces move
to the continuation, ``context + continuation`` is encoded whole and split after the context's
own tokens; lmcli puts ``<bos>`` first, as it reads every text. A context and its longest
continuation longer than the model's context lose the context's first tokens (lm-evaluation-harness
cuts each pair on its own; the groups here share one cut).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lmcli.errors import LmcliError
from lmcli.generate.decoding import left_pad
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer

ROWS = 256  # continuations scored in one forward at most (each repeats its context's KV cache)
Scored = tuple[float, bool]  # (sum of the continuation's log-probabilities, greedy would produce it)


@dataclass(frozen=True)
class Group:
    """A context's token ids (``<bos>`` first) and the continuations' ids scored after it."""

    context: list[int]
    continuations: list[list[int]]


def encode_pairs(tokenizer: Tokenizer, context: str, continuations: list[str]) -> Group:
    """The group of ``context`` and ``continuations`` as lm-evaluation-harness's ``_encode_pair``
    splits each pair (see the module doc), with ``<bos>`` first."""
    spaces = len(context) - len(context.rstrip())
    head, moved = (context[:-spaces], context[-spaces:]) if spaces else (context, "")
    own = tokenizer.encode(head)
    wholes = tokenizer.encode_batch([head + moved + c for c in continuations])
    conts = [whole[len(own) :] for whole in wholes]
    for text, ids in zip(continuations, conts, strict=True):
        if not ids:
            raise LmcliError(f"the continuation {text!r} encodes to no token after its context")
    return Group([tokenizer.bos_id, *own], conts)


@fastpath.scoped
@torch.inference_mode()
def score_groups(
    model: Transformer,
    groups: list[Group],
    batch_size: int = 8,
    on_batch: Callable[[int], None] | None = None,
) -> list[list[Scored]]:
    """(log-likelihood, greedy) of every continuation of every group, in order; up to
    ``batch_size`` groups and ``ROWS`` continuations per forward (longest first), ``on_batch(n)``
    after each batch that finished n groups."""
    block = model.config.block_size
    # a group of many continuations is scored in parts of at most ROWS (its context run once
    # per part): the KV cache is repeated once per continuation, so memory stays bounded
    parts = [
        (i, Group(g.context, g.continuations[at : at + ROWS]))
        for i, g in enumerate(groups)
        for at in range(0, len(g.continuations), ROWS)
    ]
    fitted = [_fit(g, block) for _, g in parts]
    order = sorted(range(len(parts)), key=lambda p: (-len(fitted[p].context), p))
    out: list[list[Scored]] = [[] for _ in groups]
    scored_parts: list[list[Scored]] = [[] for _ in parts]
    left = Counter(i for i, _ in parts)  # parts of each group not scored yet
    for chunk in _batches(order, fitted, batch_size, block):
        done = 0
        for p, scored in zip(chunk, _score_batch(model, [fitted[p] for p in chunk]), strict=True):
            scored_parts[p] = scored
            left[parts[p][0]] -= 1
            done += left[parts[p][0]] == 0
        if on_batch is not None and done:
            on_batch(done)
    for (i, _), scored in zip(parts, scored_parts, strict=True):
        out[i].extend(scored)
    return out


def _fit(group: Group, block: int) -> Group:
    """The group with its context cut (its first tokens dropped) so that it and its longest
    continuation fit the model's context: at most ``block`` inputs."""
    longest = max(len(c) for c in group.continuations)
    if longest > block:
        raise LmcliError(f"a continuation of {longest} tokens does not fit the model's context of {block}")
    return Group(group.context[-(block + 1 - longest) :], group.continuations)


def _batches(order: list[int], groups: list[Group], size: int, block: int) -> Iterator[list[int]]:
    """``order`` in batches of at most ``size`` groups whose longest context and longest
    continuation fit the context together (the KV cache's columns hold the left padding too)."""
    chunk: list[int] = []
    width = longest = rows = 0
    for i in order:
        w, n = len(groups[i].context), max(len(c) for c in groups[i].continuations)
        r = len(groups[i].continuations)
        if chunk and (len(chunk) == size or max(width, w) + max(longest, n) - 1 > block or rows + r > ROWS):
            yield chunk
            chunk, width, longest, rows = [], 0, 0, 0
        chunk.append(i)
        width, longest, rows = max(width, w), max(longest, n), rows + r
    if chunk:
        yield chunk


def _score_batch(model: Transformer, groups: list[Group]) -> list[list[Scored]]:
    """The continuations of a batch of groups: contexts into a KV cache, then continuations on it."""
    device = next(model.parameters()).device
    longest = max(len(c) for g in groups for c in g.continuations)
    contexts = [g.context for g in groups]
    rows = [c for g in groups for c in g.continuations]
    parent = torch.tensor([i for i, g in enumerate(groups) for _ in g.continuations], device=device)
    idx, start = left_pad(contexts, 0, device)
    cache = KVCache.for_model(model, len(groups), max_len=idx.size(1) + longest - 1, start=start)
    cache.reserve(idx.size(1) + longest - 1)
    first = model(idx, cache, last_only=True)[:, -1].float().log_softmax(-1)  # (G, V)
    first_ids = torch.tensor([c[0] for c in rows], device=device)
    total = first.index_select(0, parent).gather(1, first_ids[:, None]).squeeze(1)  # (R,)
    misses = (first.argmax(-1).index_select(0, parent) != first_ids).float()  # (R,)
    if longest > 1:
        cache.reorder(parent)  # one row per continuation, its context's keys and values
        x = torch.zeros(len(rows), longest - 1, dtype=torch.long)
        index, row_of, targets = [], [], []
        for r, c in enumerate(rows):
            x[r, : len(c) - 1] = torch.tensor(c[:-1])
            index += range(r * (longest - 1), r * (longest - 1) + len(c) - 1)
            row_of += [r] * (len(c) - 1)
            targets += c[1:]
        if index:
            flat = torch.tensor(index, device=device)
            logp = model(x.to(device), cache, output_index=flat).float().log_softmax(-1)  # (N, V)
            tgt = torch.tensor(targets, device=device)
            row = torch.tensor(row_of, device=device)
            total.index_add_(0, row, logp.gather(1, tgt[:, None]).squeeze(1))
            misses.index_add_(0, row, (logp.argmax(-1) != tgt).float())
    flat_scores = list(zip(total.tolist(), (misses == 0).tolist(), strict=True))
    out, at = [], 0
    for g in groups:
        out.append(flat_scores[at : at + len(g.continuations)])
        at += len(g.continuations)
    return out
