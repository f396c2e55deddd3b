"""Perplexity and bits per byte of a model on text, by sliding windows or line by line.

Conventions (also in the README):
- A text is scored as ``<bos> text``: every token of the text is predicted once, the first
  one from ``<bos>`` alone. Perplexity is exp(total NLL / total scored tokens).
- Sliding windows, as in the Hugging Face perplexity guide and fairseq's --context-window: windows
  of ``context`` tokens start every ``stride`` tokens; each scores only the tokens no earlier
  window scored, so every token is scored exactly once, with up to ``context - stride`` tokens of
  extra left context. ``stride == context`` gives plain non-overlapping blocks.
- Bits per byte = total NLL / ln 2 / UTF-8 bytes of the text scored, which compares models with
  different tokenizers.
- ``--per-line`` scores each line on its own as ``<bos> line <eos>``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmcli import fastpath
from lmcli.config import EvalConfig
from lmcli.data.windows import IGNORE
from lmcli.errors import LmcliError
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lmcli.checkpoint import Checkpoint
    from lmcli.data.pairs import PairSet


@dataclass
class Score:
    """Totals of an evaluation; the reported figures are derived from them."""

    tokens: int = 0  # tokens scored
    nll: float = 0.0  # total negative log-likelihood, nats
    bytes: int = 0  # UTF-8 bytes of the text scored
    unknown: int = 0  # <unk> tokens in the input
    lines: list[dict] = field(default_factory=list)

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.mean_nll, 700.0))

    @property
    def bits_per_token(self) -> float:
        return self.mean_nll / math.log(2)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes if self.bytes else float("nan")

    def report(self) -> dict[str, float | int]:
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "nll_per_token": self.mean_nll,
            "perplexity": self.perplexity,
            "bits_per_token": self.bits_per_token,
            "bits_per_byte": self.bits_per_byte,
            "unknown_tokens": self.unknown,
        }


def windows(n: int, context: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, scored) of each window over ``n`` ids: predict ids[end-scored:end] from
    ids[begin:end-1]. Every id but the first is scored exactly once."""
    if not 1 <= stride <= context:
        raise LmcliError(f"stride must be between 1 and the context ({context}), got {stride}")
    prev_end = 1  # ids[0] is <bos>: never predicted
    begin = 0
    while prev_end < n:
        end = min(begin + context + 1, n)  # context inputs predict up to ids[end-1]
        yield begin, end, end - prev_end
        prev_end = end
        begin += stride


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@fastpath.scoped
@torch.inference_mode()
def score_ids(
    model: Transformer, ids: list[int], context: int, stride: int, batch_size: int = 8, progress: bool = False
) -> tuple[int, float]:
    """(tokens scored, total NLL) of ``ids`` (starting with <bos>) by sliding windows."""
    if len(ids) < 2:
        raise LmcliError("text is too short: at least one token is needed after <bos>")
    if context > model.config.block_size:
        raise LmcliError(f"context {context} exceeds the model's block size {model.config.block_size}")
    device = next(model.parameters()).device
    spans = list(windows(len(ids), context, stride))
    data = torch.tensor(ids, dtype=torch.long)
    total, count = 0.0, 0
    bar = _bar(progress, len(spans))
    for chunk in _batches(spans, batch_size):
        width = max(end - begin - 1 for begin, end, _ in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        y = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
        for row, (begin, end, scored) in enumerate(chunk):
            n = end - begin - 1
            x[row, :n] = data[begin : end - 1]
            y[row, n - scored : n] = data[end - scored : end]  # right padding is harmless: causal
        logits = model(x.to(device))
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += int((y != IGNORE).sum())
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return count, total


def _bar(enabled: bool, total: int):  # noqa: ANN202 - a tqdm bar or None
    if not enabled or total < 20:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="window", desc="scoring", file=sys.stderr, leave=False, disable=None)


def evaluate_text(
    model: Transformer,
    tokenizer: Tokenizer,
    text: str,
    *,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> Score:
    """Perplexity and bits per byte of one text, as ``<bos> text``, by sliding windows."""
    if not text.strip():
        raise LmcliError("the text to evaluate is empty")
    context = context or model.config.block_size
    body = tokenizer.encode(text)
    ids = [tokenizer.bos_id, *body]
    count, nll = score_ids(model, ids, context, stride or context, batch_size, progress)
    return Score(count, nll, len(text.encode("utf-8")), tokenizer.count_unknown(body))


@fastpath.scoped
@torch.inference_mode()
def evaluate_lines(
    model: Transformer,
    tokenizer: Tokenizer,
    lines: list[str],
    *,
    batch_size: int = 32,
    context: int | None = None,
) -> Score:
    """Score each non-empty line on its own as ``<bos> line <eos>``; per-line results in ``lines``."""
    context = context or model.config.block_size
    device = next(model.parameters()).device
    score = Score()
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        body = tokenizer.encode(line)
        score.unknown += tokenizer.count_unknown(body)
        items.append((number, line, [tokenizer.bos_id, *body, tokenizer.eos_id]))
    if not items:
        raise LmcliError("no non-empty lines to evaluate")
    results: dict[int, dict] = {}
    short = [it for it in items if len(it[2]) - 1 <= context]
    for number, line, ids in (it for it in items if len(it[2]) - 1 > context):  # longer than the context
        count, nll = score_ids(model, ids, context, context)
        results[number] = _line_record(number, line, count, nll)
    for chunk in _batches(sorted(short, key=lambda it: len(it[2])), batch_size):
        width = max(len(ids) for _, _, ids in chunk) - 1
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        y = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
        for row, (_, _, ids) in enumerate(chunk):
            t = torch.tensor(ids)
            x[row, : len(ids) - 1], y[row, : len(ids) - 1] = t[:-1], t[1:]
        logits = model(x.to(device)).float()
        nll = F.cross_entropy(logits.transpose(1, 2), y.to(device), reduction="none").sum(dim=1)  # (B,)
        for row, (number, line, ids) in enumerate(chunk):
            results[number] = _line_record(number, line, len(ids) - 1, nll[row].item())
    for number in sorted(results):
        rec = results[number]
        score.lines.append(rec)
        score.tokens += rec["tokens"]
        score.nll += rec["nll"]
        score.bytes += len(rec.pop("_text").encode("utf-8")) + 1  # the line and its newline
    return score


def _line_record(number: int, line: str, tokens: int, nll: float) -> dict:
    return {
        "line": number,
        "tokens": tokens,
        "nll": nll,
        "perplexity": math.exp(min(nll / tokens, 700.0)),
        "_text": line,
    }


@fastpath.scoped
@torch.inference_mode()
def evaluate_pairs(
    model: Transformer, tokenizer: Tokenizer, pairs: PairSet, prefix_lm: bool, batch_size: int = 32
) -> Score:
    """Target-only perplexity of a translation model on tokenized pairs."""
    from lmcli.data.pairs import collate

    device = next(model.parameters()).device
    score = Score()
    for start in range(0, len(pairs), batch_size):
        batch = collate(pairs, list(range(start, min(start + batch_size, len(pairs)))), tokenizer.pad_id)
        mask = batch.y != IGNORE
        logits = model(
            batch.x.to(device),
            prefix_len=batch.prefix_len.to(device) if prefix_lm else None,
            output_mask=mask.to(device),
        )
        score.nll += F.cross_entropy(logits.float(), batch.y[mask].to(device), reduction="sum").item()
        score.tokens += int(mask.sum())
        for row in range(batch.y.size(0)):
            target = batch.y[row][batch.y[row] != IGNORE].tolist()
            score.bytes += len(tokenizer.decode(target).encode("utf-8")) + 1
    return score


def evaluate_run(
    ckpt: Checkpoint, cfg: EvalConfig, paths: tuple[str, ...] = (), *, progress: bool = True
) -> tuple[Score, str]:
    """Evaluate a loaded checkpoint on paths, a dataset, parallel files, or its own validation split.

    Returns the score and a short description of what was evaluated.
    """
    model, tok = ckpt.model, ckpt.tokenizer
    context = cfg.context or model.config.block_size
    stride = cfg.stride or context
    if stride > context:
        raise LmcliError(f"stride must be between 1 and the context ({context}), got {stride}")
    with fastpath.inference(model):
        if ckpt.train_config.task == "translation":
            pairs, what = _pairs_to_evaluate(ckpt, cfg)
            return evaluate_pairs(model, tok, pairs, ckpt.train_config.prefix_lm, cfg.batch_size), what
        text, what = _text_to_evaluate(ckpt, cfg, paths)
        if cfg.per_line:
            lines = text.splitlines()
            return evaluate_lines(model, tok, lines, batch_size=cfg.batch_size, context=context), what
        score = evaluate_text(
            model, tok, text, context=context, stride=stride, batch_size=cfg.batch_size, progress=progress
        )
        return score, what


def _pairs_to_evaluate(ckpt: Checkpoint, cfg: EvalConfig) -> tuple[PairSet, str]:
    """A translation model's pairs: --source/--target files, or its run's validation pairs."""
    from lmcli.data.pairs import AlignedFiles, tokenize_pairs
    from lmcli.data.train_data import cache_dir_of, load_train_data

    block_size = ckpt.model.config.block_size
    if cfg.source or cfg.target:
        if not (cfg.source and cfg.target):
            raise LmcliError("give both --source and --target")
        corpus = AlignedFiles(cfg.source, cfg.target)
        pairs = tokenize_pairs(corpus, ckpt.tokenizer, block_size + 1, cache_dir_of(ckpt.train_config))
        return pairs, f"{cfg.source} -> {cfg.target}, target tokens only"
    data = load_train_data(ckpt.train_config, block_size=block_size, tokenizer=ckpt.tokenizer, progress=False)
    return data.val, "the run's validation pairs, target tokens only"


def _text_to_evaluate(ckpt: Checkpoint, cfg: EvalConfig, paths: tuple[str, ...]) -> tuple[str, str]:
    """The text to score: paths, a dataset, or the run's own validation split."""
    from lmcli.data.corpus import open_corpus
    from lmcli.data.train_data import load_train_data

    if paths or cfg.dataset:
        corpus = open_corpus(paths, cfg.dataset, cfg.split, cfg.text_column)
        docs = ["".join(doc) for doc in corpus.documents()]
        return ("\n".join(docs) if cfg.dataset else "".join(docs)), corpus.description
    if ckpt.meta.get("source") == "huggingface":
        raise LmcliError("give text to evaluate: a Hugging Face model folder has no validation split")
    block_size = ckpt.model.config.block_size
    data = load_train_data(ckpt.train_config, block_size=block_size, tokenizer=ckpt.tokenizer, progress=False)
    return ckpt.tokenizer.decode(data.val.tolist()), "the run's validation split"
