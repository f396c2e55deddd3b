"""Sampling: the next-token rule (temperature, top-k, top-p, min-p, repetition penalty) and a
streaming ``generate`` on the KV cache.

Reproducibility: sample ``j`` of every prompt draws from its own ``torch.Generator`` seeded with
``seed + j``, so the same seed gives the same text whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli import fastpath
from lmcli.config import SampleConfig
from lmcli.generate.decoding import Prompt, make_prompt, needs_slide, prefill, slide, step
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer


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
        drop_sorted = mass_before >= top_p  # the first token is always kept
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


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generators: list[torch.Generator] | None = None,
    banned: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Choose one token per row from logits (B, V); return (tokens (B,), their log-probs (B,)).

    Log-probs are the model's own (temperature 1, before filtering), so they mean the same
    whatever the settings. Temperature 0 is greedy. ``banned`` is a token id never chosen
    (e.g. ``<eos>`` before a minimum length).
    """
    logits = logits.float()
    logprobs = F.log_softmax(logits, dim=-1)
    if banned is not None:
        logits = logits.clone()
        logits[:, banned] = float("-inf")
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / temperature if temperature != 1.0 else logits
        probs = filter_logits(scaled, top_k, top_p, min_p).softmax(dim=-1)
        tokens = draw(probs, generators)
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


@dataclass
class Generated:
    """One generated continuation."""

    prompt_index: int
    sample_index: int
    ids: list[int] = field(default_factory=list)  # generated tokens (no <eos>)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos", "stop" (a stop string) or "length"


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    hits = [text.index(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else None


class NextToken:
    """``cfg``'s next-token rule with its per-row state: the seeded generators (one per row,
    ``seed + sample index``) and, with a repetition penalty, the tokens each row has seen."""

    def __init__(
        self, cfg: SampleConfig, out: list[Generated], rows: list[list[int]], vocab: int, device: torch.device
    ) -> None:
        self.cfg = cfg
        self.seen = seen_mask(rows, vocab, device) if cfg.repetition_penalty != 1.0 else None
        self.generators = None
        if cfg.temperature > 0:
            self.generators = [
                torch.Generator(device=device).manual_seed(cfg.seed + g.sample_index) for g in out
            ]

    def __call__(self, logits: Tensor, eos_id: int | None) -> tuple[Tensor, Tensor]:
        """Tokens (B,) and their log-probs (B,); ``eos_id`` (when given) is never chosen."""
        cfg = self.cfg
        if self.seen is not None:
            logits = penalize_seen(logits, self.seen, cfg.repetition_penalty)
        tokens, logprobs = sample_next(
            logits,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            min_p=cfg.min_p,
            generators=self.generators,
            banned=eos_id,
        )
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        return tokens, logprobs


class Collector:
    """Appends each step's tokens to the rows' ``Generated``, ends a row at ``<eos>`` or a stop
    string, and streams new text to ``on_text(row, piece)``. Text is decoded during generation
    only when stop strings or ``on_text`` need it."""

    def __init__(
        self,
        out: list[Generated],
        tokenizer: Tokenizer,
        stops: tuple[str, ...],
        on_text: Callable[[int, str], None] | None,
    ) -> None:
        self.out, self.tokenizer, self.stops, self.on_text = out, tokenizer, stops, on_text
        self.done = [False] * len(out)
        self.n_done = 0
        self.streamed = [""] * len(out)
        self.watch_text = bool(stops) or on_text is not None

    def add(self, tokens: Tensor, logprobs: Tensor, rows: list[list[int]]) -> bool:
        """Record one token per row; True once every row has ended."""
        eos = self.tokenizer.eos_id
        for r, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
            if self.done[r]:
                continue
            g = self.out[r]
            rows[r].append(tok)
            if tok == eos:
                self._end(r, "eos")
                continue
            g.ids.append(tok)
            g.logprobs.append(lp)
            if self.watch_text:
                text = self.tokenizer.decode(g.ids)
                cut = _cut_at_stop(text, self.stops)
                if cut is not None:
                    self._end(r, "stop")
                    text = cut
                self._stream(r, text, complete=False)
        return self.n_done == len(self.out)

    def _end(self, r: int, reason: str) -> None:
        self.done[r], self.out[r].finish_reason = True, reason
        self.n_done += 1

    def _stream(self, r: int, text: str, complete: bool) -> None:
        """Hand ``on_text`` what is new in ``text`` (not a half-decoded character, unless complete)."""
        if self.on_text is None or len(text) <= len(self.streamed[r]):
            return
        if complete or not text.endswith("\ufffd"):
            self.on_text(r, text[len(self.streamed[r]) :])
            self.streamed[r] = text

    def finish(self) -> None:
        """Every row's final text (cut at its first stop string), streamed to the end."""
        for r, g in enumerate(self.out):
            text = self.tokenizer.decode(g.ids)
            cut = _cut_at_stop(text, self.stops)
            g.text = cut if cut is not None else text
            self._stream(r, g.text, complete=True)


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    cfg: SampleConfig,
    *,
    prefix_lm: bool = False,
    on_text: Callable[[int, str], None] | None = None,
) -> list[Generated]:
    """Sample ``cfg.num_samples`` continuations of every prompt (token ids), all in one batch.

    ``on_text(row, piece)`` receives text as it is generated (rows are prompt-major:
    ``prompt * num_samples + sample``). ``<eos>`` is never chosen before ``cfg.min_new_tokens``.
    """
    n = cfg.num_samples
    out = [Generated(p, j) for p in range(len(prompts)) for j in range(n)]
    if cfg.max_new_tokens == 0 or not prompts:
        return out
    collector = Collector(out, tokenizer, cfg.stop, on_text)
    with fastpath.inference(model):
        cache, logits = prefill(model, prompts, tokenizer.pad_id, prefix_lm=prefix_lm)
        cache.reserve(cache.length + cfg.max_new_tokens)
        if n > 1:
            cache.expand(n)
            logits = logits.repeat_interleave(n, dim=0)
        rows = [list(prompts[g.prompt_index]) for g in out]  # every row's full token sequence
        next_token = NextToken(cfg, out, rows, logits.size(-1), logits.device)
        with fastpath.step_threads(model, len(out)):
            for i in range(cfg.max_new_tokens):
                tokens, logprobs = next_token(logits, tokenizer.eos_id if i < cfg.min_new_tokens else None)
                if collector.add(tokens, logprobs, rows):
                    break
                if needs_slide(cache):
                    cache, logits = slide(model, rows, tokenizer.pad_id)
                else:
                    logits = step(model, cache, tokens)
    collector.finish()
    return out


def sample_texts(
    model: Transformer,
    tokenizer: Tokenizer,
    texts: list[str],
    cfg: SampleConfig,
    *,
    translation: bool = False,
    prefix_lm: bool = False,
    on_text: Callable[[int, str], None] | None = None,
) -> tuple[list[Generated], list[Prompt]]:
    """Encode prompt texts (``<bos> text``, or ``<bos> source <sep>`` for a translation model)
    and sample continuations of all of them as one batch."""
    prompts = [make_prompt(t, tokenizer, model.config.block_size, translation) for t in texts]
    out = generate(model, tokenizer, [p.ids for p in prompts], cfg, prefix_lm=prefix_lm, on_text=on_text)
    return out, prompts
