"""The rules of sampling, as pure functions: the next-token rule (repetition penalty, temperature,
top-k, top-p, min-p, a seeded draw) and the text rules (stop strings, text decoded a few tokens
at a time). ``engine.py`` applies them to every row; they hold no state of their own.

Reproducibility: a row draws from its own ``torch.Generator`` (``draw``), so the same seed
gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.text.tokenizer import Tokenizer


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Set to -inf every token outside top-k, the top-p nucleus, or below min-p; logits (B, V).

    Top-k keeps exactly ``k`` tokens, ties included. Top-p keeps the smallest set of most likely
    tokens whose probability mass reaches ``p``. Min-p keeps tokens with probability at least
    ``min_p`` times that of the most likely one.
    """
    if top_k and top_k < logits.size(-1):
        kept = torch.topk(logits, top_k, dim=-1).indices
        mask = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, kept, False)
        logits = logits.masked_fill(mask, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # the most likely token stays, also when p underflows to 0
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def seen_mask(history: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> Tensor:
    """(B, V) bool: True where token v occurs in row b's history."""
    seen = torch.zeros(len(history), vocab_size, dtype=torch.bool)
    for row, tokens in enumerate(history):
        if tokens:
            seen[row, torch.tensor(tokens)] = True
    return seen.to(device)


def penalize_seen(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make the tokens marked in ``seen`` (B, V) less likely, the whole batch at once (CTRL:
    divide positive logits, multiply negative ones by ``penalty``)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sampling_probs(
    logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> Tensor:
    """The distribution a token is drawn from (B, V): logits over ``temperature`` (> 0), filtered."""
    scaled = logits / temperature if temperature != 1.0 else logits
    return filter_logits(scaled, top_k, top_p, min_p).softmax(dim=-1)


def choose(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generators: list[torch.Generator] | None = None,
    banned: int | None = None,
    banned_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token per row of logits (B, V): (tokens (B,), the log-probs of every token (B, V)).

    Log-probs are the logits' own (temperature 1, before filtering), so they mean the same
    whatever the settings. Temperature 0 is greedy. ``banned`` is a token id never chosen (e.g.
    ``<eos>`` before a minimum length): in every row, or in the rows ``banned_rows`` (R,) only.
    """
    logits = logits.float()
    logprobs = F.log_softmax(logits, dim=-1)
    if banned is not None:
        logits = logits.clone()
        if banned_rows is None:
            logits[:, banned] = float("-inf")
        else:
            logits[banned_rows, banned] = float("-inf")
    if temperature == 0:
        return logits.argmax(dim=-1), logprobs
    return draw(sampling_probs(logits, temperature, top_k, top_p, min_p), generators), logprobs


def sample_next(logits: Tensor, **settings: Any) -> tuple[Tensor, Tensor]:
    """``choose`` (the same keyword settings), with the log-probs of the chosen tokens only:
    (tokens (B,), their log-probs (B,))."""
    tokens, logprobs = choose(logits, **settings)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def draw(probs: Tensor, generators: list[torch.Generator] | None = None) -> Tensor:
    """One token per row of ``probs`` (B, V), row ``i`` drawn with ``generators[i]``.

    With generators this is the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, which is how
    ``torch.multinomial(p, 1, generator=g)`` draws: the same tokens from the same seeds, but the
    noise of every row is drawn first and the race is run once for the whole batch.
    """
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    noise = torch.empty_like(probs)
    for row, g in enumerate(generators):
        noise[row].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """``text`` up to its first stop string, or None if it holds none."""
    hits = [text.index(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` might begin a stop string (not shown yet)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


PENDING_TOKENS = 8  # tokens held back at most while they decode to half a character


class TextTail:
    """A row's text, decoded a few tokens at a time (the work per step does not grow with the
    text): ``add`` returns the text that tokens ``ids[read:]`` add, decoded together with the
    tokens before them (``ids[prefix:read]``) so that characters and words spanning tokens come
    out as a full decode would give them. Only the last ``keep`` characters are held, which is
    what a stop string check needs."""

    def __init__(self, keep: int) -> None:
        self.prefix = self.read = 0
        self.keep = keep
        self.tail = ""  # the last ``keep`` characters of the text so far

    def add(self, tokenizer: Tokenizer, ids: list[int]) -> str:
        """New text since the last call ('' while the last tokens end inside a character)."""
        before = tokenizer.decode(ids[self.prefix : self.read]) if self.read > self.prefix else ""
        after = tokenizer.decode(ids[self.prefix :])
        if after.endswith("\ufffd") and len(ids) - self.read < PENDING_TOKENS:
            return ""  # half a character: wait for the rest of its bytes
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(ids)
        self.tail = (self.tail + new)[-self.keep :] if self.keep else ""
        return new
