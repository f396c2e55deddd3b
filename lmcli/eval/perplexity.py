"""Perplexity and bits per byte of a model on text, by sliding windows or line by line.

Conventions (also in the README):
- A text is scored as ``<bos> text``: every token of the text is predicted once, the first
  one from ``<bos>`` alone. Perplexity is exp(total NLL / total scored tokens). A tokenizer that
  puts no ``<bos>`` first (``Tokenizer.add_bos``, an imported model's) scores ``text`` as
  transformers does by default: its first token is context, never predicted.
- Sliding windows, as in the Hugging Face perplexity guide and fairseq's --context-window: windows
  of ``context`` tokens start every ``stride`` tokens; each scores only the tokens no earlier
  window scored, so every token is scored exactly once, with up to ``context - stride`` tokens of
  extra left context. ``stride == context`` gives plain non-overlapping blocks.
- Bits per byte = total NLL / ln 2 / UTF-8 bytes of the text scored, which compares models with
  different tokenizers.
- ``--per-line`` scores each line on its own as ``<bos> line <eos>`` (``<bos>`` as above).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lmcli.config.commands import EvalConfig
from lmcli.data.corpus import batched
from lmcli.data.windows import IGNORE, Batch
from lmcli.errors import LmcliError
from lmcli.model import fastpath
from lmcli.model.transformer import Transformer
from lmcli.tasks import make_task
from lmcli.text.tokenizer import Tokenizer, split_pieces

LINE_BLOCK = 4096  # --per-line: lines read, sorted by length and scored at a time
LONG_LINE = 1 << 16  # --per-line: a line of more characters is tokenized and scored as a stream

if TYPE_CHECKING:
    from lmcli.data.examples import ExampleSet
    from lmcli.formats.checkpoint import Checkpoint


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
    prev_end = 1  # ids[0] (<bos>, or the text's first token) is never predicted
    begin = 0
    while prev_end < n:
        end = min(begin + context + 1, n)  # context inputs predict up to ids[end-1]
        yield begin, end, end - prev_end
        prev_end = end
        begin += stride


def stream_windows(
    chunks: Iterable[list[int]], context: int, stride: int
) -> Iterator[tuple[int, int, int, list[int]]]:
    """The windows of ``windows`` over ids that arrive in chunks, each with its ids
    (``ids[begin:end]``): the same windows, in the same order, holding only about a window of
    ids at a time however long the stream."""
    if not 1 <= stride <= context:
        raise LmcliError(f"stride must be between 1 and the context ({context}), got {stride}")
    source = iter(chunks)
    buf: list[int] = []  # ids[base:]
    base, prev_end, begin, ended = 0, 1, 0, False
    while True:
        while not ended and base + len(buf) < begin + context + 1:
            more = next(source, None)
            if more is None:
                ended = True
            else:
                buf.extend(more)
        known = base + len(buf)  # all of the ids once ``ended``; else at least a full window
        if prev_end >= known:
            return
        end = min(begin + context + 1, known)
        yield begin, end, end - prev_end, buf[begin - base : end - base]
        prev_end = end
        begin += stride
        if begin - base >= 1 << 16:  # drop the ids no window needs any more, now and then
            del buf[: begin - base]
            base = begin


def window_batch(chunk: list[tuple[int, int, int, list[int]]]) -> tuple[Tensor, Tensor]:
    """A batch of ``stream_windows``' windows: inputs (B, T) right-padded with 0 (harmless: the
    attention is causal) and targets (B, T), ``IGNORE`` but at each window's scored positions."""
    width = max(end - begin - 1 for begin, end, _, _ in chunk)
    x = torch.zeros(len(chunk), width, dtype=torch.long)
    y = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
    for row, (begin, end, scored, ids) in enumerate(chunk):
        n = end - begin - 1
        data = torch.tensor(ids, dtype=torch.long)
        x[row, :n] = data[:-1]
        y[row, n - scored : n] = data[n + 1 - scored :]
    return x, y


def score_ids(
    model: Transformer, ids: list[int], context: int, stride: int, batch_size: int = 8, progress: bool = False
) -> tuple[int, float]:
    """(tokens scored, total NLL) of ``ids`` (starting with <bos>) by sliding windows."""
    return score_stream(model, [ids], context, stride, batch_size, progress)


@fastpath.scoped
@torch.inference_mode()
def score_stream(
    model: Transformer,
    chunks: Iterable[list[int]],
    context: int,
    stride: int,
    batch_size: int = 8,
    progress: bool = False,
) -> tuple[int, float]:
    """(tokens scored, total NLL) of ids arriving in chunks (the first id is <bos>) by sliding
    windows; memory is flat in the number of ids."""
    if context > model.config.block_size:
        raise LmcliError(f"context {context} exceeds the model's block size {model.config.block_size}")
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync per batch
    count = 0
    bar = _bar(progress)
    for chunk in batched(stream_windows(chunks, context, stride), batch_size):
        x, y = window_batch(chunk)
        logits = model(x.to(device))
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1), reduction="sum"
        )
        total += nll
        count += int((y != IGNORE).sum())  # on the host
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    if count == 0:
        raise LmcliError("text is too short: at least one token is needed after <bos>")
    return count, total.item()


def _bar(enabled: bool):  # noqa: ANN202 - a tqdm bar or None
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit="window", desc="scoring", file=sys.stderr, leave=False, disable=None)


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
    return evaluate_chunks(
        model, tokenizer, [text], context=context, stride=stride, batch_size=batch_size, progress=progress
    )


def evaluate_chunks(
    model: Transformer,
    tokenizer: Tokenizer,
    chunks: Iterable[str],
    *,
    context: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> Score:
    """``evaluate_text`` of the text that ``chunks`` make up, read as it is scored: memory stays
    flat however long the text. It is encoded in the pieces the token cache uses
    (``split_pieces``); a text of one piece is encoded whole, as ``evaluate_text`` always did."""
    score = Score()
    has_text = False

    def ids() -> Iterator[list[int]]:
        nonlocal has_text
        if tokenizer.add_bos:
            yield [tokenizer.bos_id]
        for chunk in chunks:
            has_text = has_text or bool(chunk.strip())
            score.bytes += len(chunk.encode("utf-8"))
            for piece in split_pieces(chunk):
                body = tokenizer.encode(piece)
                score.unknown += tokenizer.count_unknown(body)
                yield body

    context = context or model.config.block_size
    try:
        score.tokens, score.nll = score_stream(model, ids(), context, stride or context, batch_size, progress)
    except LmcliError:
        if not has_text:
            raise LmcliError("the text to evaluate is empty") from None
        raise
    if not has_text:
        raise LmcliError("the text to evaluate is empty")
    return score


@fastpath.scoped
@torch.inference_mode()
def evaluate_lines(
    model: Transformer,
    tokenizer: Tokenizer,
    lines: Iterable[str],
    *,
    batch_size: int = 32,
    context: int | None = None,
    on_line: Callable[[dict], None] | None = None,
) -> Score:
    """Score each non-empty line on its own as ``<bos> line <eos>``; per-line results in
    ``lines``, or, with ``on_line``, handed to it in line order as they are scored (then memory
    stays flat however many lines). Lines are read ``LINE_BLOCK`` at a time."""
    score = Score()
    block: list[str] = []
    first = 1
    for line in lines:
        block.append(line)
        if len(block) == LINE_BLOCK:
            _score_line_block(model, tokenizer, block, first, score, batch_size, context, on_line)
            first, block = first + len(block), []
    if block:
        _score_line_block(model, tokenizer, block, first, score, batch_size, context, on_line)
    if score.tokens == 0:
        raise LmcliError("no non-empty lines to evaluate")
    return score


def _score_line_block(
    model: Transformer,
    tokenizer: Tokenizer,
    lines: list[str],
    first: int,
    score: Score,
    batch_size: int,
    context: int | None,
    on_line: Callable[[dict], None] | None,
) -> None:
    """Score lines numbered ``first``, ``first + 1``, ... into ``score`` (see ``evaluate_lines``)."""
    context = context or model.config.block_size
    device = next(model.parameters()).device
    items = []
    results: dict[int, dict] = {}
    for number, line in enumerate(lines, first):
        if not line.strip():
            continue
        if len(line) > LONG_LINE:  # never its ids all at once: a 100 MB line took gigabytes
            count, nll = score_stream(model, _line_ids(tokenizer, line, score), context, context)
            results[number] = _line_record(number, line, count, nll)
            continue
        body = tokenizer.encode(line)
        score.unknown += tokenizer.count_unknown(body)
        items.append((number, line, [*tokenizer.with_bos(body), tokenizer.eos_id]))
    short = [it for it in items if len(it[2]) - 1 <= context]
    for number, line, ids in (it for it in items if len(it[2]) - 1 > context):  # longer than the context
        count, nll = score_ids(model, ids, context, context)
        results[number] = _line_record(number, line, count, nll)
    for chunk in batched(sorted(short, key=lambda it: len(it[2])), batch_size):
        width = max(len(ids) for _, _, ids in chunk) - 1
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        y = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
        for row, (_, _, ids) in enumerate(chunk):
            t = torch.tensor(ids)
            x[row, : len(ids) - 1], y[row, : len(ids) - 1] = t[:-1], t[1:]
        logits = model(x.to(device)).float()
        nll = F.cross_entropy(logits.transpose(1, 2), y.to(device), reduction="none").sum(dim=1)  # (B,)
        for (number, line, ids), line_nll in zip(chunk, nll.tolist(), strict=True):  # one copy a batch
            results[number] = _line_record(number, line, len(ids) - 1, line_nll)
    for number in sorted(results):
        rec = results[number]
        score.tokens += rec["tokens"]
        score.nll += rec["nll"]
        score.bytes += len(rec.pop("_text").encode("utf-8")) + 1  # the line and its newline
        if on_line is not None:
            on_line(rec)
        else:
            score.lines.append(rec)


def _line_ids(tokenizer: Tokenizer, line: str, score: Score) -> Iterator[list[int]]:
    """``<bos> line <eos>`` as ids, the line encoded in the pieces the token cache uses
    (``split_pieces``), its unknown characters counted into ``score``."""
    if tokenizer.add_bos:
        yield [tokenizer.bos_id]
    for piece in split_pieces(line):
        body = tokenizer.encode(piece)
        score.unknown += tokenizer.count_unknown(body)
        yield body
    yield [tokenizer.eos_id]


def _line_record(number: int, line: str, tokens: int, nll: float) -> dict:
    return {
        "line": number,
        "tokens": tokens,
        "nll": nll,
        "perplexity": math.exp(min(nll / tokens, 700.0)),
        "_text": line,
    }


def forward_scored(model: torch.nn.Module, batch: Batch, prefix_lm: bool = False) -> tuple[Tensor, Tensor]:
    """Logits (N, V) and targets (N,) of the positions a batch scores: training's loss, its
    validation loss and ``evaluate_pairs`` all read them.

    Language modelling scores every position; translation and SFT only the response tokens,
    whose flat indices the batch brings from the host: the model gathers those rows (no
    boolean-mask selection, so no device-to-host sync and no graph break under torch.compile)
    and the vocabulary projection skips prompt and padding positions. With ``prefix_lm`` each
    prompt attends to itself both ways (``tasks.Task.prefix_lm``); a batch that numbers its
    documents (``--document-mask``) keeps attention within each.
    """
    prefix = batch.prefix_len if prefix_lm else None
    if batch.index is not None:
        targets = batch.y.reshape(-1).index_select(0, batch.index)  # (N,)
        return model(batch.x, prefix_len=prefix, output_index=batch.index), targets
    if batch.document is not None:
        logits = model(batch.x, document=batch.document)
        return logits.view(-1, logits.size(-1)), batch.y.reshape(-1)
    logits = model(batch.x, prefix_len=prefix)
    return logits.view(-1, logits.size(-1)), batch.y.reshape(-1)


@fastpath.scoped
@torch.inference_mode()
def evaluate_pairs(
    model: Transformer, tokenizer: Tokenizer, pairs: ExampleSet, prefix_lm: bool, batch_size: int = 32
) -> Score:
    """Response-only perplexity of a translation or SFT model on tokenized examples: the scored
    positions gathered by index, as in training."""
    from lmcli.data.examples import collate, pad_multiple

    device = next(model.parameters()).device
    multiple = pad_multiple(False, device)
    score = Score()
    nll = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync per batch
    context = model.config.block_size
    for start in range(0, len(pairs), batch_size):
        indices = list(range(start, min(start + batch_size, len(pairs))))
        host = collate(pairs, indices, tokenizer.pad_id, context, multiple)
        logits, targets = forward_scored(model, host.to(device), prefix_lm)
        nll += F.cross_entropy(logits.float(), targets, reduction="sum")
        score.tokens += int(host.index.numel())  # counted on the host
        for row in range(host.y.size(0)):
            target = host.y[row][host.y[row] != IGNORE].tolist()
            score.bytes += len(tokenizer.decode(target).encode("utf-8")) + 1
    score.nll += nll.item()
    return score


def evaluate_run(
    ckpt: Checkpoint,
    cfg: EvalConfig,
    paths: tuple[str, ...] = (),
    *,
    progress: bool = True,
    on_line: Callable[[dict], None] | None = None,
) -> tuple[Score, str]:
    """Evaluate a loaded checkpoint on paths, a dataset, parallel files, or its own validation split.

    Returns the score and a short description of what was evaluated. The text is read as it is
    scored; with ``cfg.per_line`` and ``on_line``, each line's record goes to ``on_line``.
    """
    model, tok = ckpt.model, ckpt.tokenizer
    context = cfg.context or model.config.block_size
    stride = cfg.stride or context
    if stride > context:
        raise LmcliError(f"stride must be between 1 and the context ({context}), got {stride}")
    task = make_task(ckpt.train_config)
    if not task.own_split and not (paths or cfg.dataset):
        raise LmcliError(
            f"this is {task.described}: give text to score (files or --dataset), --task FILE, or "
            "--preferences FILE"
        )
    with fastpath.inference(model):
        if task.examples is not None and task.own_split:  # supervised examples: the response tokens only
            pairs, what = _pairs_to_evaluate(ckpt, cfg)
            return evaluate_pairs(model, tok, pairs, task.prefix_lm, cfg.batch_size), what
        chunks, what = _text_to_evaluate(ckpt, cfg, paths)
        if cfg.per_line:
            lines = split_lines(chunks)
            score = evaluate_lines(
                model, tok, lines, batch_size=cfg.batch_size, context=context, on_line=on_line
            )
            return score, what
        score = evaluate_chunks(
            model, tok, chunks, context=context, stride=stride, batch_size=cfg.batch_size, progress=progress
        )
        return score, what


def split_lines(chunks: Iterable[str]) -> Iterator[str]:
    """The lines of the text ``chunks`` make up, as ``str.splitlines`` of the whole text gives them."""
    carry = ""
    for chunk in chunks:
        parts = (carry + chunk).splitlines(keepends=True)
        carry = ""
        if parts and (parts[-1].endswith("\r") or parts[-1].splitlines()[0] == parts[-1]):
            carry = parts.pop()  # unfinished, or a "\r" that a "\n" may follow
        for part in parts:
            yield part.splitlines()[0] if part.splitlines() else ""
    if carry:
        yield from carry.splitlines()


def _pairs_to_evaluate(ckpt: Checkpoint, cfg: EvalConfig) -> tuple[ExampleSet, str]:
    """A translation model's pairs (--source/--target files), or the validation examples of a
    model trained on examples (translation, SFT)."""
    from lmcli.data.examples import tokenize_examples
    from lmcli.data.pairs import AlignedFiles
    from lmcli.data.train_data import cache_dir_of, load_train_data

    block_size = ckpt.model.config.block_size
    task = make_task(ckpt.train_config)
    if cfg.source or cfg.target:
        if not task.reads_pair_files:
            raise LmcliError("--source and --target are for translation models")
        if not (cfg.source and cfg.target):
            raise LmcliError("give both --source and --target")
        corpus = AlignedFiles(cfg.source, cfg.target)
        pairs = tokenize_examples(corpus, ckpt.tokenizer, block_size + 1, cache_dir_of(ckpt.train_config))
        return pairs, f"{cfg.source} -> {cfg.target}, {task.scored} tokens only"
    data = load_train_data(ckpt.train_config, block_size=block_size, tokenizer=ckpt.tokenizer, progress=False)
    return data.val, f"the run's validation {task.examples}, {task.scored} tokens only"


def _text_to_evaluate(ckpt: Checkpoint, cfg: EvalConfig, paths: tuple[str, ...]) -> tuple[Iterator[str], str]:
    """The text to score, as chunks read lazily: paths, a dataset, or the run's own validation split."""
    from lmcli.data.corpus import open_corpus
    from lmcli.data.train_data import load_train_data

    if paths or cfg.dataset:
        corpus = open_corpus(paths, cfg.dataset, cfg.split, cfg.text_column)
        return _corpus_chunks(corpus.documents(), "\n" if cfg.dataset else ""), corpus.description
    if ckpt.meta.get("source") in ("huggingface", "gguf"):
        what = "a Hugging Face model folder" if ckpt.meta["source"] == "huggingface" else "a GGUF file"
        raise LmcliError(f"give text to evaluate: {what} has no validation split")
    block_size = ckpt.model.config.block_size
    data = load_train_data(ckpt.train_config, block_size=block_size, tokenizer=ckpt.tokenizer, progress=False)
    return _decoded_chunks(ckpt.tokenizer, data.val), "the run's validation split"


def _corpus_chunks(documents: Iterator[Iterator[str]], separator: str) -> Iterator[str]:
    """The chunks of every document, ``separator`` between documents."""
    for i, doc in enumerate(documents):
        if i and separator:
            yield separator
        yield from doc


def _decoded_chunks(tokenizer: Tokenizer, ids: Any, size: int = 1 << 16) -> Iterator[str]:
    """The text of ``ids`` (a token array), decoded ``size`` tokens at a time; a cut that falls
    inside a character waits for the tokens that complete it."""
    start = 0
    while start < len(ids):
        end = min(start + size, len(ids))
        text = tokenizer.decode(ids[start:end].tolist())
        while text.endswith("\ufffd") and end < len(ids) and end - start < size + 8:
            end += 1
            text = tokenizer.decode(ids[start:end].tolist())
        yield text
        start = end
