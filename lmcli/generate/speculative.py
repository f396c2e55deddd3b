"""Speculative decoding: a small draft model proposes tokens, the model checks them all at once.

The standard rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023): per round, for one row,

1. the draft proposes ``k`` tokens, one cached step each, token ``i`` drawn from ``q_i``;
2. the model reads the row's last token and the ``k`` proposals in one cached forward: ``p_1``
   .. ``p_{k+1}``;
3. proposal ``i`` is accepted while ``u < p_i(x_i) / q_i(x_i)``, ``u`` uniform; at the first
   rejection the row takes a token drawn from ``max(0, p_i - q_i)`` (normalized) instead; when
   all ``k`` are accepted it takes one more from ``p_{k+1}``. Every token taken is then
   distributed as the model alone would draw it: the draft changes the speed, never the text's
   distribution. At temperature 0 a proposal is accepted when it is ``p_i``'s argmax, and the
   row takes that argmax at the first one that is not: the same tokens as decoding without a
   draft;
4. both KV caches are cut back to the tokens taken (``KVCache.truncate``).

``p_i`` and ``q_i`` are the engine's own sampling rule (``rules.sampling_probs``: temperature,
top-k, top-p, min-p) on logits processed as the engine processes them at that position: the
repetition penalty over the row's tokens and the proposals before it, ``<eos>`` banned before
``min_new_tokens``. Draws and the acceptance test use the row's own generator. The tokens taken
go through ``Row.record`` one by one, as the engine's do (text, stop strings, the end), with
the log-probs the engine reports.

A row is speculated alone (batch 1): rows accept different numbers of tokens, and speculative
decoding serves one sequence's latency. The draft must share the model's tokenizer
(``check_draft``). A row whose prompt and ``max_new_tokens`` do not ``fit`` either model's
context, or whose prompt attends to itself both ways (``--prefix-lm``), is decoded without a
draft (``sampling.generate`` does that).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.generate.decoding import prefill
from lmcli.generate.engine import Row
from lmcli.generate.rules import draw, penalize_seen, sampling_probs
from lmcli.model import fastpath
from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer


@dataclass
class Draft:
    """A draft model and how many tokens it proposes a round."""

    model: Transformer
    tokenizer: Tokenizer
    tokens: int = 4  # k


@dataclass
class DraftStats:
    """What speculation did for one row."""

    rounds: int = 0  # the model's forwards after the prompt
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # proposals taken

    def add(self, drafted: int, accepted: int) -> None:
        """One round: ``drafted`` proposals, ``accepted`` of them taken."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


def _merges(tok: Tokenizer) -> list:
    return (json.loads(tok.to_json()).get("model") or {}).get("merges") or []


def check_draft(target: Tokenizer, draft: Tokenizer, where: str) -> None:
    """One line unless the draft's tokenizer is the model's: the same vocabulary (every token's
    id), merges and special ids."""
    differs = None
    if target.hf.get_vocab(with_added_tokens=True) != draft.hf.get_vocab(with_added_tokens=True):
        differs = f"its vocabulary ({draft.vocab_size} tokens, the model's {target.vocab_size})"
    elif _merges(target) != _merges(draft):
        differs = "its merges"
    else:
        roles = ("bos", "eos", "pad")
        ids = {r: (getattr(target, f"{r}_id"), getattr(draft, f"{r}_id")) for r in roles}
        odd = [f"{r} {b} (the model's {a})" for r, (a, b) in ids.items() if a != b]
        differs = f"its special ids: {', '.join(odd)}" if odd else None
    if differs:
        raise LmcliError(f"the draft model {where} has another tokenizer than the model: {differs}")


def processed(raw: Tensor, row: Row, proposed: list[int], eos: int, first: int = 0) -> tuple[Tensor, Tensor]:
    """The logits (n, V) of positions ``first`` .. ``first + n - 1`` of a round, as the engine
    processes a row's: position j follows the row's tokens and ``proposed[:j]`` (the repetition
    penalty sees them). Returns (penalized: what log-probs are read from, and the same with
    ``<eos>`` banned where the row is still below ``min_new_tokens``: what tokens are drawn from)."""
    logits = raw.float()
    n, V = logits.shape
    cfg = row.cfg
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(n, V, dtype=torch.bool)
        seen[:, torch.tensor(row.sequence, dtype=torch.long)] = True
        for j in range(n):
            before = proposed[: first + j]
            if before:
                seen[j, torch.tensor(before, dtype=torch.long)] = True
        logits = penalize_seen(logits, seen.to(logits.device), cfg.repetition_penalty)
    early = [j for j in range(n) if len(row.ids) + first + j < cfg.min_new_tokens]
    if not early:
        return logits, logits
    banned = logits.clone()
    banned[early, eos] = float("-inf")
    return logits, banned


def distribution(logits: Tensor, row: Row) -> Tensor:
    """The engine's distribution (n, V) at each position; one-hot argmaxes at temperature 0."""
    cfg = row.cfg
    if cfg.temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).float()
    return sampling_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)


def accept(
    p: Tensor, q: Tensor, proposed: list[int], generator: torch.Generator | None, greedy: bool
) -> tuple[int, int]:
    """Step 3 of the module doc: (how many proposals are taken, the token after them).
    ``p``: (k + 1, V) the model's distributions, ``q``: (k, V) the draft's, ``proposed``: k tokens."""
    for i, x in enumerate(proposed):
        if greedy:
            if int(p[i].argmax()) != x:
                return i, int(p[i].argmax())
            continue
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[i, x] < p[i, x]:
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if residual.sum() <= 0:  # p and q equal up to rounding: p itself
            residual = p[i]
        return i, int(draw((residual / residual.sum())[None], [generator])[0])
    last = p[len(proposed)]
    return len(proposed), int(last.argmax()) if greedy else int(draw(last[None], [generator])[0])


def _fit(logits: Tensor, vocab: int) -> Tensor:
    """Draft logits (n, V') on the model's vocabulary V: cut, or padded with -inf."""
    if logits.size(-1) >= vocab:
        return logits[..., :vocab]
    return F.pad(logits, (0, vocab - logits.size(-1)), value=float("-inf"))


def fits(model: Transformer, draft: Draft, prompt: list[int], max_new_tokens: int) -> bool:
    """Whether a row can be speculated: its prompt and new tokens fit both models' contexts."""
    return len(prompt) + max_new_tokens <= min(model.config.block_size, draft.model.config.block_size)


def _cache(model: Transformer, tokens: list[int], pad: int, slack: int) -> KVCache:
    """A batch-1 cache holding ``tokens`` (possibly none); sliding-window layers keep their window
    and ``slack`` columns more, the most a round cuts back."""
    if tokens:
        return prefill(model, [tokens], pad, window_slack=slack)[0]
    return KVCache.for_model(model, 1, window_slack=slack)


class Speculator:
    """Rows decoded with a draft, one at a time (see the module doc).

    Per row, between rounds: the model's cache holds the sequence but its last token (``last``);
    the draft's holds the sequence but ``pending`` (its last one or two tokens)."""

    def __init__(self, model: Transformer, draft: Draft, tokenizer: Tokenizer) -> None:
        self.model, self.draft, self.tokenizer = model, draft, tokenizer
        self.vocab = model.config.vocab_size

    def run(self, row: Row, prompt: list[int], on_text: Callable[[str], None] | None = None) -> DraftStats:
        """Decode ``row`` (from ``prompt``, which must ``fit``) to its end; ``on_text(piece)``
        receives its text as it comes. A small model's steps run on one thread, as without a
        draft (``fastpath.step_threads``; switching between rounds would cost more)."""
        with fastpath.step_threads(self.model, 1, native=False):  # (the target checks k + 1 rows)
            return self._run(row, prompt, on_text)

    def _run(self, row: Row, prompt: list[int], on_text: Callable[[str], None] | None) -> DraftStats:
        pad = self.tokenizer.pad_id
        slack = self.draft.tokens + 1  # a round feeds at most that many tokens, then cuts back
        target = _cache(self.model, prompt[:-1], pad, slack)
        draft = _cache(self.draft.model, prompt[:-1], pad, slack)
        last, pending = prompt[-1], [prompt[-1]]
        device = target.k.device
        generator = row.generator(device) if row.cfg.temperature > 0 else None
        stats = DraftStats()
        while row.finish_reason is None:
            k = max(min(self.draft.tokens, row.cfg.max_new_tokens - len(row.ids) - 1), 0)
            proposed, q = self._propose(row, draft, pending, k, generator)
            known = target.length + 1  # the sequence's length
            taken, tokens, logprobs = self._verify(row, target, last, proposed, q, generator)
            stats.rounds, stats.drafted, stats.accepted = (
                stats.rounds + 1,
                stats.drafted + k,
                stats.accepted + taken,
            )
            if not k:
                pending = [*pending, tokens[-1]]
            elif taken < k:  # the draft read x_1 .. x_{k-1}: keep x_1 .. x_taken
                draft.truncate(known + taken)
                pending = [tokens[-1]]
            else:  # all taken: the draft never read x_k
                pending = [proposed[-1], tokens[-1]]
            last = tokens[-1]
            for tok, lp in zip(tokens, logprobs, strict=True):
                text = row.record(tok, lp, self.tokenizer)
                if on_text is not None and text:
                    on_text(text)
                if row.finish_reason is not None:
                    break
        return stats

    def _propose(
        self, row: Row, cache: KVCache, pending: list[int], k: int, generator: torch.Generator | None
    ) -> tuple[list[int], Tensor]:
        """``k`` draft tokens and the distributions (k, V) they were drawn from; the draft reads
        ``pending`` first, then each proposal but the last."""
        proposed: list[int] = []
        dists: list[Tensor] = []
        feed = pending
        for i in range(k):
            idx = torch.tensor([feed], device=cache.k.device)
            raw = _fit(self.draft.model(idx, cache, last_only=True)[0, -1:], self.vocab)  # (1, V)
            _, logits = processed(raw, row, proposed, self.tokenizer.eos_id, first=i)
            dist = distribution(logits, row)[0]
            tok = int(dist.argmax()) if generator is None else int(draw(dist[None], [generator])[0])
            proposed.append(tok)
            dists.append(dist)
            feed = [tok]
        return proposed, torch.stack(dists) if dists else torch.empty(0, self.vocab)

    def _verify(
        self,
        row: Row,
        cache: KVCache,
        last: int,
        proposed: list[int],
        q: Tensor,
        generator: torch.Generator | None,
    ) -> tuple[int, list[int], list[float]]:
        """The model reads ``last`` and the proposals in one forward: how many are taken, the
        tokens the row takes (those and one more), their log-probs; its cache keeps ``last``
        and the taken proposals."""
        start = cache.length
        raw = self.model(torch.tensor([[last, *proposed]], device=cache.k.device), cache)[0]  # (k + 1, V)
        penalized, logits = processed(raw, row, proposed, self.tokenizer.eos_id)
        taken, token = accept(distribution(logits, row), q, proposed, generator, row.cfg.temperature == 0)
        cache.truncate(start + 1 + taken)
        tokens = [*proposed[:taken], token]
        logprobs = F.log_softmax(penalized[: len(tokens)], dim=-1)
        return taken, tokens, [float(logprobs[j, t]) for j, t in enumerate(tokens)]
