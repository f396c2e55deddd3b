"""Batched beam search on the KV cache: beams are the batch dimension.

Scores follow Hugging Face ``generate``: a hypothesis that ends (``<eos>`` or the length limit)
scores ``sum of log-probs / generated_length ** length_penalty``, its length counting the
``<eos>``; of the ``2k`` best continuations of an input only the top ``k`` may end; the best
``k`` that go on become the next beams, and the cache rows follow their parents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.config.commands import BeamConfig
from lmcli.device import to_host
from lmcli.generate.decoding import TEXT, Prompt, make_prompt, needs_slide, prefill, slide, step
from lmcli.model import fastpath
from lmcli.model.kv_cache import check_fits
from lmcli.model.transformer import Transformer
from lmcli.tasks import TextPrompt
from lmcli.text.tokenizer import Tokenizer

DEAD = -1.0e9  # score of a beam slot with nothing left to continue


@dataclass
class Hypothesis:
    """A finished beam."""

    ids: list[int]  # generated tokens, without <eos>
    score: float  # logprob / length ** length_penalty
    logprob: float  # sum of token log-probs, <eos> included when it ended so
    ended: bool  # True: ended with <eos>; False: stopped at the length limit


def banned_ngram_tokens(seq: list[int], n: int) -> set[int]:
    """Tokens that would repeat an n-gram already in ``seq``."""
    if n <= 0 or len(seq) < n:
        return set()
    prefix = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
    return {seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i : i + n - 1]) == prefix}


def _adjust(logprobs: Tensor, rows: list[list[int]], cfg: BeamConfig, generated: int, eos_id: int) -> Tensor:
    """Forbid <eos> before min-new-tokens and repeated n-grams; logprobs (R, V)."""
    if generated < cfg.min_new_tokens:
        logprobs[:, eos_id] = float("-inf")
    if cfg.no_repeat_ngram_size:
        for r, seq in enumerate(rows):
            banned = banned_ngram_tokens(seq, cfg.no_repeat_ngram_size)
            if banned:
                logprobs[r, list(banned)] = float("-inf")
    return logprobs


Beam = tuple[int, int, float]  # (parent row, token, accumulated log-prob)


@torch.inference_mode()
def beam_search(
    model: Transformer,
    prompts: list[list[int]],
    cfg: BeamConfig,
    *,
    eos_id: int,
    pad_id: int,
    input_lens: list[int] | None = None,
    prefix_lm: bool = False,
) -> list[list[Hypothesis]]:
    """The ``cfg.nbest`` best hypotheses of each prompt (token ids), best first.

    ``input_lens`` (default: prompt lengths) sets each input's length limit,
    ``cfg.max_new_for(input_len)``: a * input_len + b new tokens at most.
    """
    k = cfg.beam_size
    check_fits(model, len(prompts) * k, f"beam-size {k} x {len(prompts)} input(s)")
    limits = [cfg.max_new_for(n) for n in (input_lens or [len(p) for p in prompts])]
    pools: list[list[Hypothesis]] = [[] for _ in prompts]
    with fastpath.inference(model):
        cache, logits = prefill(model, prompts, pad_id, prefix_lm=prefix_lm, window_slack=0)
        width = cache.length  # prompt columns, the same in every beam of an input
        cache.reserve(width + max(limits))
        cache.expand(k)
        logits = logits.repeat_interleave(k, dim=0)  # (A*k, V), rows input-major
        device = logits.device
        active = list(range(len(prompts)))
        rows = [list(p) for p in prompts for _ in range(k)]  # full sequences, for n-grams and sliding
        gen: list[list[int]] = [[] for _ in rows]
        scores = torch.full((len(prompts), k), DEAD, device=device)
        scores[:, 0] = 0.0  # all beams start equal: expand only the first
        generated = 0
        with fastpath.step_threads(model, len(prompts) * k):
            while active:
                A, V = len(active), logits.size(-1)
                logprobs = _adjust(F.log_softmax(logits, dim=-1), rows, cfg, generated, eos_id)
                acc = (logprobs + scores.view(-1, 1)).view(A, k * V)  # (A, k*V)
                top_scores, top_idx = torch.topk(acc, 2 * k, dim=-1)  # (A, 2k)
                # one wait for the device per step: both results come back together
                picked, picked_scores = to_host(torch.stack([top_idx // V, top_idx % V]), top_scores)
                (parents, tokens), sums = picked.tolist(), picked_scores.tolist()
                generated += 1
                kept: list[Beam] = []
                still = []
                for a, inp in enumerate(active):
                    candidates = [
                        (a * k + p, t, s) for p, t, s in zip(parents[a], tokens[a], sums[a], strict=True)
                    ]
                    running = _advance(
                        candidates, pools[inp], gen, generated, generated >= limits[inp], cfg, eos_id
                    )
                    if running:
                        still.append(inp)
                        kept.extend(running)
                if not still:
                    break
                keep_rows = [r for r, _, _ in kept]
                # rows, tokens and scores go to the device in one copy: float64 holds the ids and
                # the float32 scores exactly
                sent = torch.tensor(list(zip(*kept, strict=True)), dtype=torch.float64).to(device)  # (3, N)
                if keep_rows != list(range(cache.batch_size)):  # every beam kept its own row: nothing moves
                    # a beam's parent is a beam of the same input: the prompt columns never move
                    cache.reorder(sent[0].long(), shared=width)
                rows = [[*rows[r], t] for r, t, _ in kept]
                gen = [[*gen[r], t] for r, t, _ in kept]
                scores = sent[2].float().view(len(still), k)
                active = still
                if needs_slide(cache):
                    cache, logits = slide(model, rows, pad_id, 0)
                    width = 0  # each row re-read its own history: no columns are shared any more
                else:
                    logits = step(model, cache, sent[1].long())
    return [pool[: cfg.nbest] for pool in pools]


def _advance(
    candidates: list[Beam],
    pool: list[Hypothesis],
    gen: list[list[int]],
    generated: int,
    at_limit: bool,
    cfg: BeamConfig,
    eos_id: int,
) -> list[Beam]:
    """One input's step: of its ``2k`` best continuations (best first), those among the top ``k``
    that end join ``pool``; the best ``k`` that go on are returned, or none once it is done."""
    k = cfg.beam_size
    running: list[Beam] = []
    for rank, (row, tok, sc) in enumerate(candidates):
        if sc <= DEAD / 2:
            break  # only dead beams from here on
        if tok == eos_id or at_limit:
            if rank < k:
                ids = gen[row] if tok == eos_id else [*gen[row], tok]
                pool.append(Hypothesis(ids, sc / generated**cfg.length_penalty, sc, tok == eos_id))
                pool.sort(key=lambda h: -h.score)
                del pool[k:]
            continue
        if len(running) < k:
            running.append((row, tok, sc))
    if at_limit or not running or _done(pool, running, generated, cfg):
        return []
    while len(running) < k:  # keep k slots; the extra ones can never win
        running.append((running[0][0], running[0][1], DEAD))
    return running


def _done(
    pool: list[Hypothesis], running: list[tuple[int, int, float]], generated: int, cfg: BeamConfig
) -> bool:
    """An input is done once it has beam-size hypotheses and (without early stopping) no running
    beam can still beat the worst of them."""
    if len(pool) < cfg.beam_size:
        return False
    if cfg.early_stopping:
        return True
    best_running = running[0][2] / generated**cfg.length_penalty
    return best_running <= pool[-1].score


@dataclass
class Translation:
    """The hypotheses of one input, best first, with their detokenized text."""

    input: str
    hypotheses: list[Hypothesis]
    texts: list[str]


def beam_texts(
    model: Transformer,
    tokenizer: Tokenizer,
    texts: list[str],
    cfg: BeamConfig,
    *,
    form: TextPrompt = TEXT,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[Translation], list[Prompt]]:
    """Beam-decode every input text, ``cfg.batch_size`` inputs at a time, results in input order.

    Inputs are read in the model's prompt ``form`` (its task's): a translation model reads
    ``<bos> source <sep>``, its length limit counts source tokens, and an empty source gives an
    empty translation without decoding.
    """
    prompts = [make_prompt(t, tokenizer, model.config.block_size, form) for t in texts]
    results: list[Translation | None] = [None] * len(texts)
    todo = [i for i, t in enumerate(texts) if form.decodes(t)]
    for i in set(range(len(texts))) - set(todo):
        results[i] = Translation(texts[i], [], [""])
    todo.sort(key=lambda i: len(prompts[i].ids))  # similar lengths together: little padding
    with fastpath.inference(model):  # one scope for every chunk
        for start in range(0, len(todo), cfg.batch_size):
            chunk = todo[start : start + cfg.batch_size]
            ids = [prompts[i].ids for i in chunk]
            hyps = beam_search(
                model,
                ids,
                cfg,
                eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id,
                input_lens=[form.input_length(p) for p in ids],
                prefix_lm=form.prefix_lm,
            )
            for i, h in zip(chunk, hyps, strict=True):
                results[i] = Translation(texts[i], h, [tokenizer.decode(x.ids) for x in h])
            if on_batch is not None:
                on_batch(len(chunk))
    return [r for r in results if r is not None], prompts
