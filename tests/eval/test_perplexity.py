"""Perplexity: reference implementations, sliding-window semantics, bits per byte, per line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_TEXT, tiny_model, tiny_tokenizer

from lmcli.errors import LmcliError
from lmcli.eval.perplexity import evaluate_lines, evaluate_text, score_ids, windows


def reference_nll(model, ids: list[int], context: int, stride: int) -> tuple[int, float]:
    """Token by token: each token after ids[0] scored once, with its window's left context."""
    total, count, start = 0.0, 0, 0
    with torch.no_grad():
        for j in range(1, len(ids)):
            while j - start > context:  # keep at most `context` tokens of input
                start += stride
            logits = model(torch.tensor([ids[start:j]]))[0, -1]
            total -= F.log_softmax(logits, -1)[ids[j]].item()
            count += 1
    return count, total


@pytest.mark.parametrize("stride", [48, 16, 5, 1])
def test_perplexity_equals_a_token_by_token_reference(stride: int) -> None:
    model, tok = tiny_model(block_size=48), tiny_tokenizer()
    ids = [tok.bos_id, *tok.encode(TINY_TEXT[:154])]  # 155 ids: a few contexts of 48
    count, nll = score_ids(model, ids, context=48, stride=stride, batch_size=3)
    ref_count, ref_nll = reference_nll(model, ids, 48, stride)
    assert count == ref_count == len(ids) - 1
    assert nll == pytest.approx(ref_nll, rel=1e-5)


def test_windows_score_every_token_exactly_once() -> None:
    for n, context, stride in [(100, 16, 16), (100, 16, 3), (17, 16, 16), (5, 16, 7), (101, 10, 1)]:
        scored = []
        for begin, end, k in windows(n, context, stride):
            assert end - begin - 1 <= context and k <= end - begin - 1
            scored.extend(range(end - k, end))
        assert scored == list(range(1, n))  # each once, in order, never ids[0]


def test_stride_equal_to_context_is_plain_blocks() -> None:
    model, tok = tiny_model(block_size=16), tiny_tokenizer()
    ids = [tok.bos_id, *tok.encode(TINY_TEXT[:77])]  # 78 ids: 5 blocks of 16, the last one short
    _, nll = score_ids(model, ids, 16, 16)
    blocks = 0.0
    with torch.no_grad():
        for b in range(0, len(ids) - 1, 16):
            x, y = torch.tensor([ids[b : b + 16]]), torch.tensor(ids[b + 1 : b + 17])
            blocks += F.cross_entropy(model(x)[0, : len(y)], y, reduction="sum").item()
    assert nll == pytest.approx(blocks, rel=1e-6)


def test_report_figures_and_bits_per_byte() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    text = "the cat sat. é"
    s = evaluate_text(model, tok, text)
    assert s.tokens == len(tok.encode(text)) and s.bytes == len(text.encode("utf-8"))
    assert s.perplexity == pytest.approx(math.exp(s.nll / s.tokens))
    assert s.bits_per_byte == pytest.approx(s.nll / math.log(2) / s.bytes)
    assert s.unknown == 1  # "é" is not in the char vocabulary


def test_per_line_scores_each_line_alone() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    lines = ["the cat sat.", "", "a bird sang in the tree."]
    s = evaluate_lines(model, tok, lines)
    assert [r["line"] for r in s.lines] == [1, 3]
    alone = evaluate_lines(model, tok, [lines[2]])
    assert s.lines[1]["nll"] == pytest.approx(alone.lines[0]["nll"], rel=1e-5)
    assert s.lines[0]["tokens"] == len(tok.encode(lines[0])) + 1  # the line and <eos>
    assert s.tokens == sum(r["tokens"] for r in s.lines)


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_text_is_refused(text: str) -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    with pytest.raises(LmcliError, match="empty"):
        evaluate_text(model, tok, text)


@pytest.mark.parametrize("stride", [0, 49])
def test_stride_outside_1_to_context_is_refused(stride: int) -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    with pytest.raises(LmcliError, match="stride must be between 1 and the context"):
        score_ids(model, [tok.bos_id, 5, 6], context=48, stride=stride)
