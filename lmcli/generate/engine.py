"""The row engine: rows decoded together, each under every rule of its ``SampleConfig``, and the
model's steps that feed them. ``lmcli sample`` and ``lmcli chat`` (``sampling.generate``) and the
server's scheduler all drive it.

A ``Row`` is one sequence: its settings, its own ``torch.Generator`` (seeded ``seed + j`` for
sample or choice ``j``, so batching never changes which random numbers a row sees), the tokens
it has seen (repetition penalty), its processors (``RowProcessor``), what it generated (ids and
log-probs), its text (decoded a few tokens at a time, ``rules.TextTail``; text that might begin
a stop string is held back until it cannot), and how it ended: ``eos``, ``stop`` (a stop
string) or ``length`` (``max_new_tokens``). ``<eos>`` is never chosen before ``min_new_tokens``.

An ``Engine`` holds a batch of rows aligned with the rows of its KV cache, ``None`` where a row
has left (a hole), and the next-token logits of every row. ``advance`` is one step:

1. ``choose``: the next token of every live row, rows with equal settings in one call of the
   rules (``rules.choose``); before it, per row, the repetition penalty and the row's
   processors (batched over the rows whose processors share a class);
2. ``Row.record``: what the token does to its row (text, stop strings, the end): an ``Emitted``;
3. ``forward``: one cached step of the model for every row (a hole or an ended row is fed
   padding or its last token: it costs a row and changes no other row); when the context is
   full, each row's last half-context is read again (``decoding.slide``).

Rows join and leave between steps: ``start`` (prompts prefilled together, as ``generate`` does),
``fill`` and ``relayout`` (rows whose prompt was prefilled alone join a running batch, whose
cache is then a ``serve.batch_cache.BatchCache``), ``drop``. ``prefill`` is the one place a
prompt's keys and values are computed; with a ``PrefixCache`` (``prefixes``), a prompt prefilled
alone starts from its longest cached prefix, and a row that ends is cached with its reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lmcli.config.commands import SampleConfig
from lmcli.errors import LmcliError
from lmcli.generate.decoding import needs_slide, prefill, slide, step
from lmcli.generate.prefix_cache import PrefixCache
from lmcli.generate.rules import TextTail, choose, cut_at_stop, held_back, penalize_seen, seen_mask
from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer

NAN_HINT = "it would give no text (lmcli verify MODEL checks its weights)"


class RowProcessor(Protocol):
    """A row's own rule on its next-token logits, applied after the repetition penalty and
    before the sampling rule: e.g. a grammar's mask of the tokens allowed next. The rows of a
    step whose processors share a class go through one call of that class's ``apply``."""

    @classmethod
    def apply(cls, logits: Tensor, processors: list[Any]) -> Tensor:
        """The logits (G, V) of G rows, row g carrying ``processors[g]``, processed (a new tensor)."""
        ...

    def accept(self, token: int) -> None:
        """The row took ``token`` (e.g. the grammar moves on)."""
        ...

    # Optionally, ``ends``: true when the processor allows nothing but ``<eos>`` next (then
    # ``min_new_tokens`` does not ban it for the row).


class Row:
    """One sequence being decoded (see the module docstring)."""

    def __init__(
        self,
        cfg: SampleConfig,
        prompt: list[int],
        sample: int = 0,
        *,
        stream: bool = True,
        top_logprobs: int = 0,
        processors: tuple[RowProcessor, ...] = (),
    ) -> None:
        """``sample``: ``j``, the generator's seed is ``cfg.seed + j``. ``stream``: decode the
        text as it comes (stop strings need it too). ``top_logprobs``: report that many of the
        most likely tokens at each step."""
        self.cfg, self.sample = cfg, sample
        self.top_logprobs, self.processors = top_logprobs, processors
        self.sequence = list(prompt)  # the prompt and every token taken (<eos> included)
        self.ids: list[int] = []  # generated tokens (no <eos>)
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None  # "eos", "stop" or "length" once it has ended
        self.text = ""  # the whole text once it has ended, cut at its first stop string
        self.settings = (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.repetition_penalty)
        self._generator: torch.Generator | None = None
        self._seen: Tensor | None = None  # (V,) bool: tokens of the sequence (repetition penalty)
        longest = max((len(s) for s in cfg.stop), default=1)
        self._tail = TextTail(longest - 1) if stream or cfg.stop else None  # a stop ends in new text
        self._held = ""  # decoded, not shown: it might begin a stop string
        self._shown = 0  # characters shown

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.cfg.seed + self.sample)
        return self._generator

    def seen(self, vocab: int, device: torch.device) -> Tensor:
        if self._seen is None:
            self._seen = seen_mask([self.sequence], vocab, device)[0]
        return self._seen

    def record(self, token: int, logprob: float, tokenizer: Tokenizer) -> str:
        """Take ``token`` (its log-prob ``logprob``); return the text it lets show. The row ends
        at ``<eos>``, at a stop string, or with ``max_new_tokens`` tokens."""
        if logprob != logprob:  # NaN: the logits were (a NaN or infinite weight upstream)
            raise LmcliError(f"the model computes NaN or infinite logits: {NAN_HINT}")
        self.sequence.append(token)
        if self._seen is not None:
            self._seen[token] = True
        for p in self.processors:
            p.accept(token)
        if token == tokenizer.eos_id:
            return self._end("eos", tokenizer)
        self.ids.append(token)
        self.logprobs.append(logprob)
        text = self._decode(tokenizer) if self._tail is not None else ""
        if self.finish_reason is None and len(self.ids) >= self.cfg.max_new_tokens:
            text += self._end("length", tokenizer)
        return text

    def _decode(self, tokenizer: Tokenizer) -> str:
        """The new text, less what might begin a stop string; ends the row at a stop string."""
        assert self._tail is not None
        before = self._tail.tail
        new = self._tail.add(tokenizer, self.ids)
        stops = self.cfg.stop
        if not new or not stops:
            self._shown += len(new)
            return new
        if cut_at_stop(before + new, stops) is not None:  # a stop string ends in the new text
            return self._end("stop", tokenizer)
        text = self._held + new
        keep = held_back(text, stops)
        shown, self._held = text[: len(text) - keep], text[len(text) - keep :]
        self._shown += len(shown)
        return shown

    def _end(self, reason: str, tokenizer: Tokenizer) -> str:
        """End the row: its whole text, decoded once, cut at its first stop string; return what
        was not shown yet."""
        self.finish_reason = reason
        text = tokenizer.decode(self.ids)
        cut = cut_at_stop(text, self.cfg.stop)
        self.text = text if cut is None else cut
        rest = self.text[self._shown :]
        self._shown, self._held = max(self._shown, len(self.text)), ""
        return rest


@dataclass
class Emitted:
    """What one step gave one row."""

    position: int  # the row's place in the batch
    row: Row
    token: int
    logprob: float  # the token's log-prob (after the penalty and processors, at temperature 1)
    text: str  # the text it lets show ('' while it may begin a stop string or ends in a character)
    top: list[tuple[int, float]] = field(default_factory=list)  # the row's top_logprobs best tokens
    finish_reason: str | None = None  # "eos", "stop", "length" once ended ("error": an isolated failure)


def row_rules(logits: Tensor, rows: list[Row]) -> Tensor:
    """The rules of the rows themselves on their next-token logits (G, V), before the sampling
    rule: the repetition penalty (the rows' settings are equal), then the rows' processors. A
    speculative decoder applies them to the logits it verifies drafted tokens with."""
    penalty = rows[0].cfg.repetition_penalty
    if penalty != 1.0:
        seen = torch.stack([r.seen(logits.size(-1), logits.device) for r in rows])
        logits = penalize_seen(logits, seen, penalty)
    if any(r.processors for r in rows):
        logits = apply_processors(logits, rows)
    return logits


def apply_processors(logits: Tensor, rows: list[Row]) -> Tensor:
    """The rows' processors on their logits (G, V), one call per processor class."""
    kinds: dict[type, tuple[list[int], list[Any]]] = {}
    for g, r in enumerate(rows):
        for p in r.processors:
            at, procs = kinds.setdefault(type(p), ([], []))
            at.append(g)
            procs.append(p)
    for kind, (at, procs) in kinds.items():
        if len(at) == len(rows):
            logits = kind.apply(logits, procs)
        else:
            index = torch.tensor(at, device=logits.device)
            logits = logits.index_put((index,), kind.apply(logits[index], procs))
    return logits


def _must_end(row: Row) -> bool:
    """A processor of the row allows nothing but ``<eos>`` (a complete grammar): ``min_new_tokens``
    cannot hold it back (a processor says so with a true ``ends``)."""
    return any(getattr(p, "ends", False) for p in row.processors)


class Engine:
    """Rows decoded together by one model (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        prefix_lm: bool = False,
        cache: KVCache | None = None,
        isolate: bool = False,
        prefixes: PrefixCache | None = None,
    ) -> None:
        """``prefix_lm``: prompts attend to themselves both ways (a translation source).
        ``isolate``: a failure in one row's rules ends that row only (a server's rows belong to
        different requests); else it is raised. ``prefixes``: the prefix cache prompts start
        from and finished rows go to (not with ``prefix_lm``: a source's keys depend on all of it)."""
        self.model, self.tokenizer, self.prefix_lm, self.isolate = model, tokenizer, prefix_lm, isolate
        self.prefixes = prefixes if not prefix_lm else None
        # the sliding-window layers keep only their window, unless the cache's columns are copied
        # elsewhere (a server's batch, the prefix cache)
        self.window_slack = 0 if cache is None and self.prefixes is None else None
        self.device = next(model.parameters()).device
        self.cache = cache
        self.rows: list[Row | None] = []  # one per cache row; None: a hole
        self.logits: Tensor | None = None  # (len(rows), V): every row's next-token logits
        self._fed: Tensor | None = None  # the tokens chosen for every row at once, when they were
        self.steps = 0  # the model's steps

    @property
    def live(self) -> int:
        """Rows still decoding."""
        return sum(r is not None and r.finish_reason is None for r in self.rows)

    # ------------------------------------------------------------------ rows join and leave

    def prefill(self, prompts: list[list[int]]) -> tuple[KVCache, Tensor, int]:
        """Prompts (left-padded together) through a new cache: it, their next-token logits
        (P, V), and how many tokens came from the prefix cache (one prompt alone uses it)."""
        if self.prefixes is not None and len(prompts) == 1:
            return self.prefixes.prefill(self.model, prompts[0])
        pad = self.tokenizer.pad_id
        return (
            *prefill(self.model, prompts, pad, prefix_lm=self.prefix_lm, window_slack=self.window_slack),
            0,
        )

    def start(self, prompts: list[list[int]], rows: list[Row], reserve: int = 0) -> None:
        """Decode ``rows``, ``len(rows) // len(prompts)`` per prompt in prompt order, from the
        ``prompts`` prefilled together; the cache holds ``reserve`` more tokens without growing."""
        cache, logits, _ = self.prefill(prompts)
        if self.prefixes is not None:  # its blocks are cached: the local layers keep their window
            cache = cache.ringed(self.model, self.prefixes.block)
        cache.reserve(cache.length + reserve)
        n = len(rows) // len(prompts)
        if n > 1:
            cache.expand(n)
            logits = logits.repeat_interleave(n, dim=0)
        self.cache, self.logits, self.rows, self._fed = cache, logits, list(rows), None

    def fill(self, i: int, row: Row, cache: KVCache, logits: Tensor) -> None:
        """Put ``row``, its prompt prefilled alone (``cache``, ``logits`` (1, V)), into hole ``i``;
        its prompt must be no longer than the batch's filled columns."""
        assert self.cache is not None and self.logits is not None
        self.cache.fill(i, cache)  # a BatchCache (serve/batch_cache.py)
        self.logits[i] = logits[0]
        self.rows[i] = row
        self._fed = None

    def relayout(self, keep: list[int], joining: list[tuple[KVCache, Tensor, list[Row]]]) -> None:
        """Keep rows ``keep`` (in that order), then append the rows of each prompt prefilled alone
        (its cache, its logits (1, V), its rows); the cache lays them out anew (a BatchCache)."""
        assert self.cache is not None
        parts = [self.logits[keep]] if keep and self.logits is not None else []
        rows = [self.rows[i] for i in keep]
        for _, logits, new in joining:
            parts.append(logits.expand(len(new), -1))
            rows += new
        self.cache.relayout(keep, [(c, len(new)) for c, _, new in joining])
        self.logits = torch.cat(parts) if parts else None
        self.rows, self._fed = rows, None

    def drop(self, i: int) -> None:
        """Row ``i`` leaves: a hole, never chosen for again."""
        self.rows[i], self._fed = None, None

    def reset(self, cache: KVCache | None = None) -> None:
        """No rows: ``cache`` (or none) instead of the old one."""
        self.cache, self.rows, self.logits, self._fed = cache, [], None, None

    # ------------------------------------------------------------------ a step

    def advance(self, emit: Callable[[list[Emitted]], None] | None = None) -> list[Emitted]:
        """One step: every live row's next token, handed to ``emit`` (a server delivers them and
        drops the rows that ended) before the model's step (if any row goes on)."""
        emitted = self.choose()
        if self.prefixes is not None:
            self._keep_ended(emitted)
        if emit is not None:
            emit(emitted)
        if self.live:
            self.forward()
        return emitted

    def _keep_ended(self, emitted: list[Emitted]) -> None:
        """Rows that ended well (not in error) go to the prefix cache: prompt and reply."""
        assert self.prefixes is not None and self.cache is not None
        for e in emitted:
            if e.finish_reason in ("eos", "stop", "length"):
                self.prefixes.keep_row(self.cache, e.position, e.row.sequence)

    def choose(self) -> list[Emitted]:
        """The next token of every live row, rows with equal settings together."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.rows):
            if r is not None and r.finish_reason is None:
                groups.setdefault(r.settings, []).append(i)
        self._fed = None
        out: list[Emitted] = []
        for idx in groups.values():
            out += self._choose_group(idx)
        return out

    def _choose_group(self, idx: list[int]) -> list[Emitted]:
        """Rows ``idx``, whose settings are equal: their tokens, log-probs and what they did. With
        ``isolate``, a failure ends only the rows it belongs to (``finish_reason`` "error"): a
        group that fails is chosen for again row by row, and a row whose own rules fail ends."""
        assert self.logits is not None
        rows: list[Row] = [self.rows[i] for i in idx]
        try:
            tokens, chosen, best = self._pick(idx, rows)
        except Exception as exc:
            if not self.isolate:
                raise
            if len(idx) == 1:
                return [self._failed(idx[0], rows[0], exc)]
            return [e for i in idx for e in self._choose_group([i])]
        out = []
        for i, r, tok, lp, top in zip(idx, rows, tokens.tolist(), chosen.tolist(), best, strict=True):
            try:
                text = r.record(tok, lp, self.tokenizer)
            except Exception as exc:
                if not self.isolate:
                    raise
                out.append(self._failed(i, r, exc))
                continue
            out.append(Emitted(i, r, tok, lp, text, top, r.finish_reason))
        if len(idx) == len(self.rows):
            self._fed = tokens
        return out

    def _pick(self, idx: list[int], rows: list[Row]) -> tuple[Tensor, Tensor, list[list[tuple[int, float]]]]:
        """The rows' tokens (G,), their log-probs (G,) and each row's ``top_logprobs`` best."""
        cfg = rows[0].cfg
        whole = len(idx) == len(self.rows)
        logits = row_rules(self.logits if whole else self.logits[idx], rows)  # (G, V)
        early = [g for g, r in enumerate(rows) if len(r.ids) < r.cfg.min_new_tokens and not _must_end(r)]
        partly = 0 < len(early) < len(rows)
        tokens, logprobs = choose(
            logits,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            min_p=cfg.min_p,
            generators=[r.generator(logits.device) for r in rows] if cfg.temperature > 0 else None,
            banned=self.tokenizer.eos_id if early else None,
            banned_rows=torch.tensor(early, device=logits.device) if partly else None,
        )
        k = max(r.top_logprobs for r in rows)
        top = logprobs.topk(k, dim=-1) if k else None
        best: list[list[tuple[int, float]]] = []
        for g, r in enumerate(rows):
            n = r.top_logprobs if top is not None else 0
            best.append(
                list(zip(top.indices[g, :n].tolist(), top.values[g, :n].tolist(), strict=True)) if n else []
            )
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), best

    def _failed(self, i: int, row: Row, exc: Exception) -> Emitted:
        """Row ``i`` ends with an error (``isolate``): the message says what failed."""
        row.finish_reason = "error"
        row.text = f"{type(exc).__name__}: {exc}"
        return Emitted(i, row, -1, float("nan"), "", [], "error")

    def forward(self) -> None:
        """One cached step of the model: every row's last token in, the next logits out; when the
        context is full, every row's last half-context is read again instead."""
        assert self.cache is not None
        pad = self.tokenizer.pad_id
        self.steps += 1
        if needs_slide(self.cache):
            seqs = [r.sequence if r is not None else [pad] for r in self.rows]
            self.cache, self.logits = slide(self.model, seqs, pad, self.window_slack)
            return
        tokens = self._fed
        if tokens is None:
            last = [r.sequence[-1] if r is not None else pad for r in self.rows]
            tokens = torch.tensor(last, device=self.device)
        self.logits = step(self.model, self.cache, tokens)
        if self.prefixes is not None and self.cache.ring is not None:
            self._keep_blocks()

    def _keep_blocks(self) -> None:
        """With a prefix cache and a ring (the sliding-window layers keep their last columns
        only): every row that has just completed a block caches it now, while the ring holds it
        (a finished row's columns are gone from the ring by then)."""
        assert self.prefixes is not None and self.cache is not None
        block, end = self.prefixes.block, self.cache.length
        starts = self.cache.padding.start.tolist()
        for i, r in enumerate(self.rows):
            if r is None or r.finish_reason == "error":
                continue
            n = len(r.sequence)  # all fed: the cache holds the row's every token
            if n % block == 0 and end - starts[i] == n:
                k, v = self.cache.columns(i, end - block, end)  # (n_layer, KV, block, D)
                self.prefixes.add_block(r.sequence, k, v)
