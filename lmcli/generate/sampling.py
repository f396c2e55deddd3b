"""Sampling text: ``generate`` continues prompts (token ids) with the row engine
(``engine.py``, the rules of ``rules.py``) and streams the text as it comes; ``iter_samples``
and ``sample_texts`` do it for prompt texts, in blocks of bounded size.

Reproducibility: sample ``j`` of every prompt draws from its own ``torch.Generator`` seeded with
``seed + j``, so the same seed gives the same text whatever else is in the batch.

With a draft model (``Draft``, ``--draft``) each row is decoded alone by speculative decoding
(``speculative.py``): greedy text identical, sampled text from the same distribution, sooner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcli.config.commands import SampleConfig
from lmcli.generate.decoding import TEXT, Prompt, make_prompt
from lmcli.generate.engine import Engine, Row, RowProcessor
from lmcli.generate.prefix_cache import PrefixCache
from lmcli.generate.speculative import Draft, Speculator, fits
from lmcli.model import fastpath
from lmcli.model.kv_cache import check_fits
from lmcli.model.transformer import Transformer
from lmcli.tasks import TextPrompt
from lmcli.text.tokenizer import Tokenizer


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
    drafted: int = 0  # with a draft model: tokens it proposed, and how many were taken
    accepted: int = 0


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
    prefixes: PrefixCache | None = None,
    draft: Draft | None = None,
    processors: Callable[[], tuple[RowProcessor, ...]] = tuple,
) -> list[Generated]:
    """Sample ``cfg.num_samples`` continuations of every prompt (token ids), all in one batch
    (or only the samples numbered ``samples``, e.g. ``range(64, 128)``); with ``draft``, one
    row after the other by speculative decoding.

    ``on_text(row, piece)`` receives text as it is generated (rows are prompt-major:
    ``prompt * num_samples + sample``; text that might begin a stop string comes once it cannot).
    ``<eos>`` is never chosen before ``cfg.min_new_tokens``. ``prefix_lm``: the prompts attend
    to themselves both ways (a translation source, ``tasks.SourcePrompt``). ``prefixes``: a
    prefix cache a single prompt starts from and the finished rows go to (``lmcli chat``).
    ``processors()`` gives each row its own processors (``engine.RowProcessor``: a grammar's mask).
    """
    samples = range(cfg.num_samples) if samples is None else samples
    out = [Generated(p, j) for p in range(len(prompts)) for j in samples]
    if cfg.max_new_tokens == 0 or not out:
        return out
    if draft is not None and not prefix_lm and not processors():  # a grammar follows no drafted token
        return _drafted(model, tokenizer, prompts, cfg, out, draft, on_text)
    check_fits(model, len(out), f"{len(prompts)} prompt(s) x {len(samples)} sample(s)")
    rows = [
        Row(cfg, prompts[g.prompt_index], g.sample_index, stream=on_text is not None, processors=processors())
        for g in out
    ]
    engine = Engine(model, tokenizer, prefix_lm=prefix_lm, prefixes=prefixes)
    speed = Speed(prefill_tokens=sum(map(len, prompts)))
    with fastpath.inference(model):
        start = time.perf_counter()
        engine.start(prompts, rows, cfg.max_new_tokens)
        speed.prefill_s, start = time.perf_counter() - start, time.perf_counter()
        chosen = 0
        with fastpath.step_threads(model, len(rows)):
            while engine.live:
                for e in engine.advance():
                    chosen += 1
                    if on_text is not None and e.text:
                        on_text(e.position, e.text)
        speed.decode_s = time.perf_counter() - start
    speed.decode_tokens = chosen - len(rows)  # every token but each row's first came from a step
    for g, r in zip(out, rows, strict=True):
        g.ids, g.logprobs, g.text, g.finish_reason = r.ids, r.logprobs, r.text, r.finish_reason or "length"
        g.speed = speed
    return out


def _drafted(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    cfg: SampleConfig,
    out: list[Generated],
    draft: Draft,
    on_text: Callable[[int, str], None] | None,
) -> list[Generated]:
    """``generate``'s rows decoded one at a time with ``draft`` (a row that does not fit both
    contexts without it)."""
    check_fits(model, 1, "a row")
    speculator = Speculator(model, draft, tokenizer)
    with fastpath.inference(model), fastpath.inference(draft.model):
        for i, g in enumerate(out):
            prompt = prompts[g.prompt_index]
            if not fits(model, draft, prompt, cfg.max_new_tokens):
                one = None if on_text is None else (lambda _, piece, i=i: on_text(i, piece))
                alone = generate(
                    model,
                    tokenizer,
                    [prompt],
                    cfg,
                    on_text=one,
                    samples=range(g.sample_index, g.sample_index + 1),
                )[0]
                g.ids, g.logprobs, g.text, g.finish_reason = (
                    alone.ids,
                    alone.logprobs,
                    alone.text,
                    alone.finish_reason,
                )
                continue
            row = Row(cfg, prompt, g.sample_index, stream=on_text is not None)
            stats = speculator.run(
                row, prompt, None if on_text is None else (lambda piece, i=i: on_text(i, piece))
            )
            g.ids, g.logprobs, g.text, g.finish_reason = (
                row.ids,
                row.logprobs,
                row.text,
                row.finish_reason or "length",
            )
            g.drafted, g.accepted = stats.drafted, stats.accepted
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
    form: TextPrompt = TEXT,
    on_text: Callable[[int, str], None] | None = None,
    rows: int = BATCH_ROWS,
    draft: Draft | None = None,
    processors: Callable[[], tuple[RowProcessor, ...]] = tuple,
) -> Iterator[tuple[Generated, Prompt]]:
    """Encode prompt texts in the model's prompt ``form`` (its task's: ``<bos> text``, or
    ``<bos> source <sep>`` for a translation model) and sample ``cfg.num_samples`` continuations
    of each, ``rows`` (prompt, sample) rows at a time; yields each sample with its prompt, in
    order (prompt-major), as its block finishes. Memory stays bounded however many prompts and
    samples are asked for; the same seed gives the same text whatever the blocks (each sample
    draws from its own generator). ``draft``: decode with speculative decoding (``generate``).
    ``processors``: as ``generate``'s."""
    with fastpath.inference(model):  # one scope for every block
        for block, samples in row_blocks(len(texts), cfg.num_samples, rows):
            prompts = [make_prompt(texts[i], tokenizer, model.config.block_size, form) for i in block]
            row_text = None
            if on_text is not None:
                first = block.start * cfg.num_samples + samples.start  # rows of this block, globally

                def row_text(row: int, piece: str, first: int = first, per: int = len(samples)) -> None:
                    on_text(first + (row // per) * cfg.num_samples + row % per, piece)

            ids = [p.ids for p in prompts]
            out = generate(
                model,
                tokenizer,
                ids,
                cfg,
                prefix_lm=form.prefix_lm,
                on_text=row_text,
                samples=samples,
                draft=draft,
                processors=processors,
            )
            for g in out:
                prompt = prompts[g.prompt_index]
                g.prompt_index += block.start
                yield g, prompt


def sample_texts(
    model: Transformer, tokenizer: Tokenizer, texts: list[str], cfg: SampleConfig, **options: Any
) -> tuple[list[Generated], list[Prompt]]:
    """Every sample of ``iter_samples`` (with its keyword ``options``: ``form``, ``on_text``) as
    a list, and the encoded prompts."""
    out: list[Generated] = []
    prompts: dict[int, Prompt] = {}
    for g, prompt in iter_samples(model, tokenizer, texts, cfg, **options):
        out.append(g)
        prompts[g.prompt_index] = prompt
    return out, [prompts[i] for i in range(len(texts))]
