"""Work and memory bounded by the input's size, whatever its shape: BPE training on one long line,
streamed evaluation, prompts decoded in bounded batches, stop strings checked on the tail only."""

from __future__ import annotations

import json
import random
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_TEXT, make_run, tiny_model, tiny_tokenizer

from lmcli.config.commands import EvalConfig, SampleConfig
from lmcli.eval.perplexity import (
    evaluate_chunks,
    evaluate_lines,
    evaluate_run,
    evaluate_text,
    split_lines,
    windows,
)
from lmcli.formats.sources import load_model
from lmcli.generate.engine import Row
from lmcli.generate.rules import TextTail
from lmcli.generate.sampling import BATCH_ROWS, generate, row_blocks, sample_texts
from lmcli.model import fastpath
from lmcli.text.tokenizer import Tokenizer


def _cpu_seconds_to_train_bpe(text: str, vocab_size: int) -> tuple[float, Tokenizer]:
    start = time.process_time()  # every thread of this process: robust to other load on the machine
    tok = Tokenizer.train("bpe", iter([text]), vocab_size)
    return time.process_time() - start, tok


def test_bpe_trains_on_one_long_line_about_as_fast_as_on_ordinary_text() -> None:
    """A 300 KB line of DNA letters (one 'word' to the pre-tokenizer) took 43 s to train on, against
    0.2 s for text of the same size; it trains on bounded pieces now, and still round-trips."""
    rng = random.Random(0)
    size = 300_000
    dna = "".join(rng.choice("ACGT") for _ in range(size))
    words = [
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(5000)
    ]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(size // 60))[:size]
    text_seconds, _ = _cpu_seconds_to_train_bpe(text, 1000)
    dna_seconds, tok = _cpu_seconds_to_train_bpe(dna, 1000)
    assert dna_seconds < 10 * text_seconds + 1.0, (dna_seconds, text_seconds)
    assert tok.vocab_size == 1000
    assert tok.decode(tok.encode(dna)) == dna
    assert len(tok.encode(dna)) < size / 3  # it learned merges across the whole line


# ----------------------------------------------------------------------------- eval streams


def _full_text_nll(model, ids: list[int], context: int, stride: int, batch_size: int) -> tuple[int, float]:
    """The computation ``lmcli eval`` made before it streamed: every window of the whole id list
    built at once, ``batch_size`` windows per forward."""
    spans = list(windows(len(ids), context, stride))
    data = torch.tensor(ids)
    total, count = 0.0, 0
    with torch.inference_mode(), fastpath.inference(model):  # as lmcli.eval.perplexity did and does
        for i in range(0, len(spans), batch_size):
            chunk = spans[i : i + batch_size]
            width = max(end - begin - 1 for begin, end, _ in chunk)
            x = torch.zeros(len(chunk), width, dtype=torch.long)
            y = torch.full((len(chunk), width), -100, dtype=torch.long)
            for row, (begin, end, scored) in enumerate(chunk):
                n = end - begin - 1
                x[row, :n] = data[begin : end - 1]
                y[row, n - scored : n] = data[end - scored : end]
            logits = model(x)
            total += F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
            ).item()
            count += int((y != -100).sum())
    return count, total


@pytest.mark.parametrize("stride", [48, 11])
def test_streamed_eval_gives_exactly_the_full_text_perplexity(stride: int) -> None:
    model, tok = tiny_model(block_size=48), tiny_tokenizer()
    text = TINY_TEXT[:1000]
    ids = [tok.bos_id, *tok.encode(text)]
    expected = _full_text_nll(model, ids, 48, stride, 8)
    whole = evaluate_text(model, tok, text, context=48, stride=stride)
    cut = text.index("\n", 500) + 1  # the text arrives in two chunks, as a file's chunks end at line breaks
    chunked = evaluate_chunks(model, tok, iter([text[:cut], text[cut:]]), context=48, stride=stride)
    assert (whole.tokens, whole.nll) == (chunked.tokens, chunked.nll) == expected
    assert whole.bytes == chunked.bytes == len(text.encode())


def test_streamed_per_line_scores_equal_the_whole_text_ones() -> None:
    model, tok = tiny_model(), tiny_tokenizer()
    text = "the cat sat\r\n\nthe dog\rsat on\nthe log.\n" * 3
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]  # cuts inside lines and inside \r\n
    assert list(split_lines(pieces)) == text.splitlines()
    whole = evaluate_lines(model, tok, text.splitlines())
    streamed: list[dict] = []
    score = evaluate_lines(model, tok, split_lines(pieces), on_line=streamed.append)
    assert streamed == whole.lines and (score.tokens, score.nll) == (whole.tokens, whole.nll)


def test_eval_reads_the_text_as_it_scores_it(tmp_path: Path, monkeypatch) -> None:
    """``lmcli eval`` read the whole file into one string before scoring (10 MB -> 3.9 GB RSS)."""
    import lmcli.data.corpus as corpus

    run_dir = make_run(tmp_path / "run")
    (tmp_path / "t.txt").write_text(TINY_TEXT * 6)  # ~12 KB, read in ~500 B chunks below
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 500)
    read = []
    original = corpus._read_file

    def counting(path, stats):  # noqa: ANN001, ANN202
        for chunk in original(path, stats):
            read.append(len(chunk))
            yield chunk

    monkeypatch.setattr(corpus, "_read_file", counting)
    ckpt = load_model(run_dir, "cpu")
    at_first_forward = []
    ckpt.model.register_forward_pre_hook(
        lambda *_: at_first_forward.append(len(read)) if not at_first_forward else None
    )
    score, _ = evaluate_run(ckpt, EvalConfig(), (str(tmp_path / "t.txt"),), progress=False)
    assert len(read) >= 8 and at_first_forward[0] <= 2  # (the first chunk holds the 8 KiB head)
    assert score.bytes == len((TINY_TEXT * 6).encode())


# ----------------------------------------------------------------------------- sample batches


def test_many_prompts_are_sampled_in_bounded_batches_with_the_same_texts() -> None:
    """``sample --prompt-file`` decoded every prompt in one batch (100k prompts -> 4.2 GB)."""
    model, tok = tiny_model(), tiny_tokenizer()
    texts = [f"the {w}" for w in ("cat", "dog", "sun", "bird", "tree")] * 30  # 150 prompts
    cfg = SampleConfig(temperature=1.0, max_new_tokens=6, num_samples=2, seed=5)
    rows = []
    model.register_forward_pre_hook(lambda _m, args: rows.append(args[0].size(0)))
    out, prompts = sample_texts(model, tok, texts, cfg)
    assert max(rows) <= BATCH_ROWS and len(out) == 300 and len(prompts) == 150
    assert [(g.prompt_index, g.sample_index) for g in out] == [(p, j) for p in range(150) for j in range(2)]
    # a prompt's samples are the same as when it is sampled on its own
    for p in (0, 77, 149):
        alone, _ = sample_texts(model, tok, [texts[p]], cfg)
        assert [g.text for g in alone] == [g.text for g in out[2 * p : 2 * p + 2]]


def test_more_samples_than_a_batch_are_split_and_numbered_in_order() -> None:
    assert list(row_blocks(1, 150, 64)) == [
        (range(0, 1), range(0, 64)),
        (range(0, 1), range(64, 128)),
        (range(0, 1), range(128, 150)),
    ]
    assert list(row_blocks(5, 30, 64)) == [
        (range(0, 2), range(30)),
        (range(2, 4), range(30)),
        (range(4, 5), range(30)),
    ]


def test_a_huge_sample_count_streams_its_first_samples_at_once(tmp_path: Path) -> None:
    """``--num-samples 100000000`` allocated for every sample up front and never printed one."""
    run_dir = make_run(tmp_path / "run")
    argv = [sys.executable, "-m", "lmcli", "sample", str(run_dir), "--num-samples", "100000000"]
    proc = subprocess.Popen([*argv, "--max-new-tokens", "2", "--json"], stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
    finally:
        proc.kill()
        proc.wait()
    assert [json.loads(line)["sample"] for line in lines] == [0, 1, 2]


# ----------------------------------------------------------------------------- stop strings


def test_stop_strings_decode_a_bounded_number_of_tokens_per_step(monkeypatch) -> None:
    """``--stop`` decoded the whole text at every step: 300 tokens cost 45,000 decoded tokens."""
    model, tok = tiny_model(), tiny_tokenizer()
    decoded = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or original(ids, **kw))
    cfg = SampleConfig(temperature=1.0, max_new_tokens=300, min_new_tokens=300, seed=1, stop=("zzz",))
    out = generate(model, tok, [[tok.bos_id]], cfg)[0]
    assert len(out.ids) == 300 and out.finish_reason == "length"
    assert sum(decoded) <= 4 * 300 + 300  # a few tokens per step, plus the final text once


def test_text_decoded_by_the_tail_equals_a_full_decode_with_multibyte_characters() -> None:
    text = "héllo wörld — ✓ 日本語 and ünïcödé, done.\n" * 3
    tok = tiny_tokenizer(text, "byte")  # one token per byte: characters span 2-3 tokens
    ids = tok.encode(text)
    for stop, expected in (("日本", text[: text.index("日本")]), ("wörld —", "héllo ")):
        row = Row(SampleConfig(max_new_tokens=len(ids), stop=(stop,)), [tok.bos_id])
        streamed: list[str] = []
        for i in ids:
            streamed.append(row.record(i, 0.0, tok))
            if row.finish_reason is not None:
                break
        assert row.finish_reason == "stop" and row.text == expected
        assert "".join(streamed) == expected  # no part of the stop string was streamed
    tail, pieces = TextTail(0), []
    for n in range(1, len(ids) + 1):
        pieces.append(tail.add(tok, ids[:n]))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
