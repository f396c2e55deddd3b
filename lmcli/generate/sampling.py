"""Sampling: the next-token rule (temperature, top-k, top-p, min-p, repetition penalty) and a
streaming ``generate`` on the KV cache.

Reproducibility: sample ``j`` of every prompt draws from its own ``torch.Generator`` seeded with
``seed + j``, so the same seed gives the same text whatever else is in the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli import fastpath
from lmcli.config import SampleConfig
from lmcli.generate.decoding import Prompt, make_prompt, needs_slide, prefill, slide, step
from lmcli.generate.kv_cache import check_fits
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
class Speed:
    """How fast one ``generate`` call ran: its prompts' tokens through the prefill, and the new
    tokens of every row through the decoding steps."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    def report(self) -> dict[str, float | None]:
        """Tokens per second of the prefill and of decoding (None where nothing was timed)."""
        return {
            "prefill_tokens_per_s": round(self.prefill_tokens / self.prefill_s, 2)
            if self.prefill_s
            else None,
            "decode_tokens_per_s": round(self.decode_tokens / self.decode_s, 2) if self.decode_s else None,
        }


@dataclass
class Generated:
    """One generated continuation."""

    prompt_index: int
    sample_index: int
    ids: list[int] = field(default_factory=list)  # generated tokens (no <eos>)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos", "stop" (a stop string) or "length"
    speed: Speed = field(default_factory=Speed)  # of the generate call that made it (shared by its rows)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """``text`` up to its first stop string, or None if it holds none."""
    hits = [text.index(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else None


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
        self.watch_text = bool(stops) or on_text is not None
        longest = max((len(s) for s in stops), default=1)
        self.texts = [TextTail(longest - 1) for _ in out]  # a stop ends inside the new text
        self.streamed = [0] * len(out)  # characters handed to on_text

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
                self._watch(r, g.ids)
        return self.n_done == len(self.out)

    def _watch(self, r: int, ids: list[int]) -> None:
        """Look for a stop string where the new text could complete one; stream the new text."""
        text = self.texts[r]
        held = text.tail
        new = text.add(self.tokenizer, ids)
        if not new:
            return
        window = held + new
        cut = cut_at_stop(window, self.stops)
        if cut is not None:
            self._end(r, "stop")
            new = cut[len(held) :]
        if self.on_text is not None and new:  # (text streamed before a stop's first token stays)
            self.on_text(r, new)
            self.streamed[r] += len(new)

    def _end(self, r: int, reason: str) -> None:
        self.done[r], self.out[r].finish_reason = True, reason
        self.n_done += 1

    def finish(self) -> None:
        """Every row's final text (cut at its first stop string), streamed to the end."""
        for r, g in enumerate(self.out):
            text = self.tokenizer.decode(g.ids)
            cut = cut_at_stop(text, self.stops)
            g.text = cut if cut is not None else text
            if self.on_text is not None and len(g.text) > self.streamed[r]:
                self.on_text(r, g.text[self.streamed[r] :])
                self.streamed[r] = len(g.text)


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    cfg: SampleConfig,
    *,
    prefix_lm: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    samples: range | None = None,
) -> list[Generated]:
    """Sample ``cfg.num_samples`` continuations of every prompt (token ids), all in one batch
    (or only the samples numbered ``samples``, e.g. ``range(64, 128)``).

    ``on_text(row, piece)`` receives text as it is generated (rows are prompt-major:
    ``prompt * num_samples + sample``). ``<eos>`` is never chosen before ``cfg.min_new_tokens``.
    """
    samples = range(cfg.num_samples) if samples is None else samples
    n = len(samples)
    out = [Generated(p, j) for p in range(len(prompts)) for j in samples]
    if cfg.max_new_tokens == 0 or not prompts or not n:
        return out
    check_fits(model, len(out), f"{len(prompts)} prompt(s) x {n} sample(s)")
    collector = Collector(out, tokenizer, cfg.stop, on_text)
    speed = Speed(prefill_tokens=sum(map(len, prompts)))
    for g in out:
        g.speed = speed
    with fastpath.inference(model):
        start = time.perf_counter()
        cache, logits = prefill(model, prompts, tokenizer.pad_id, prefix_lm=prefix_lm)
        speed.prefill_s = time.perf_counter() - start
        cache.reserve(cache.length + cfg.max_new_tokens)
        if n > 1:
            cache.expand(n)
            logits = logits.repeat_interleave(n, dim=0)
        rows = [list(prompts[g.prompt_index]) for g in out]  # every row's full token sequence
        next_token = NextToken(cfg, out, rows, logits.size(-1), logits.device)
        start = time.perf_counter()
        with fastpath.step_threads(model, len(out)):
            for i in range(cfg.max_new_tokens):
                tokens, logprobs = next_token(logits, tokenizer.eos_id if i < cfg.min_new_tokens else None)
                if collector.add(tokens, logprobs, rows):
                    break
                if needs_slide(cache):
                    cache, logits = slide(model, rows, tokenizer.pad_id)
                else:
                    logits = step(model, cache, tokens)
                    speed.decode_tokens += len(out) - collector.n_done
        speed.decode_s = time.perf_counter() - start
    collector.finish()
    return out


BATCH_ROWS = 64  # rows (prompt x sample) sampled together: memory bounded however many prompts


def row_blocks(n_prompts: int, n_samples: int, rows: int = BATCH_ROWS) -> Iterator[tuple[range, range]]:
    """(prompts, samples) blocks of at most ``rows`` rows that cover every (prompt, sample) in
    prompt-major order."""
    if n_samples >= rows:
        for p in range(n_prompts):
            for s in range(0, n_samples, rows):
                yield range(p, p + 1), range(s, min(s + rows, n_samples))
    else:
        per = rows // n_samples
        for p in range(0, n_prompts, per):
            yield range(p, min(p + per, n_prompts)), range(n_samples)


def iter_samples(
    model: Transformer,
    tokenizer: Tokenizer,
    texts: list[str],
    cfg: SampleConfig,
    *,
    translation: bool = False,
    prefix_lm: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    rows: int = BATCH_ROWS,
) -> Iterator[tuple[Generated, Prompt]]:
    """Encode prompt texts (``<bos> text``, or ``<bos> source <sep>`` for a translation model)
    and sample ``cfg.num_samples`` continuations of each, ``rows`` (prompt, sample) rows at a
    time; yields each sample with its prompt, in order (prompt-major), as its block finishes.
    Memory stays bounded however many prompts and samples are asked for; the same seed gives
    the same text whatever the blocks (each sample draws from its own generator)."""
    with fastpath.inference(model):  # one scope for every block
        for block, samples in row_blocks(len(texts), cfg.num_samples, rows):
            prompts = [make_prompt(texts[i], tokenizer, model.config.block_size, translation) for i in block]
            row_text = None
            if on_text is not None:
                first = block.start * cfg.num_samples + samples.start  # rows of this block, globally

                def row_text(row: int, piece: str, first: int = first, per: int = len(samples)) -> None:
                    on_text(first + (row // per) * cfg.num_samples + row % per, piece)

            ids = [p.ids for p in prompts]
            out = generate(model, tokenizer, ids, cfg, prefix_lm=prefix_lm, on_text=row_text, samples=samples)
            for g in out:
                prompt = prompts[g.prompt_index]
                g.prompt_index += block.start
                yield g, prompt


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
    """Every sample of ``iter_samples`` as a list, and the encoded prompts."""
    out: list[Generated] = []
    prompts: dict[int, Prompt] = {}
    for g, prompt in iter_samples(
        model, tokenizer, texts, cfg, translation=translation, prefix_lm=prefix_lm, on_text=on_text
    ):
        out.append(g)
        prompts[g.prompt_index] = prompt
    return out, [prompts[i] for i in range(len(texts))]
