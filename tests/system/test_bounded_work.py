"""Work and memory bounded by the input's size, whatever its shape: BPE training on one long line,
streamed evaluation, prompts decoded in bounded batches, stop strings checked on the tail only."""

from __future__ import annotations

import random
import string
import time

from lmcli.tokenizer import Tokenizer


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
