"""Evaluation throughput: ``lmcli.eval.perplexity.evaluate_text`` against the Hugging Face perplexity
guide's sliding-window loop over ``GPT2LMHeadModel``, on the same weights and text.

Both sides tokenize the same text (the same tokenizer), read it as ``<bos> text`` and score every
token once with windows of ``context`` inputs every ``stride`` tokens. The Hugging Face side is the
guide's loop (``max_length = context + 1``, targets before the window's new tokens set to -100,
``labels=`` passed to the model, one window per forward), each window's mean loss weighted by its
number of scored labels; lmcli batches windows. The perplexities must agree to ~1e-5.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bench.common import Row, interleaved, log, run_suite
from bench.models import SMALL, check_same_logits, hf_twin, lmcli_model
from bench.texts import doc_text
from lmcli.eval.perplexity import Score, evaluate_text
from lmcli.model import fastpath
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer

BLOCK = 256
CONTEXT, STRIDE = BLOCK - 1, 128  # max_length = context + 1 = the model's positions
TEXT_CHARS = 3_000  # ~3k tokens scored with a char tokenizer, in 24 windows
GOAL = 1.0


def hf_perplexity(hf: Any, tok: Tokenizer, text: str, context: int, stride: int) -> tuple[int, float]:
    """(tokens scored, total NLL) by the Hugging Face perplexity guide's loop."""
    seq = torch.tensor([[tok.bos_id, *tok.encode(text)]])
    max_length, seq_len = context + 1, seq.size(1)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, seq_len, stride):
            end = min(begin + max_length, seq_len)
            trg_len = end - prev_end
            input_ids = seq[:, begin:end]
            target_ids = input_ids.clone()
            target_ids[:, :-trg_len] = -100
            loss = hf(input_ids, labels=target_ids).loss
            n = int((target_ids[:, 1:] != -100).sum())  # labels left after the model's shift
            nll_sum += loss.item() * n
            n_tokens += n
            prev_end = end
            if end == seq_len:
                break
    return n_tokens, nll_sum


def lmcli_perplexity(model: Transformer, tok: Tokenizer, text: str) -> Score:
    return evaluate_text(model, tok, text, context=CONTEXT, stride=STRIDE, batch_size=8)


def run() -> list[Row]:
    corpus = doc_text()
    tok = Tokenizer.train("char", iter([corpus]))
    text = corpus[100_000 : 100_000 + TEXT_CHARS]
    model = lmcli_model(tok.vocab_size, BLOCK, **SMALL).eval()
    hf = hf_twin(model, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id).eval()
    check_same_logits(model, hf, tok.vocab_size)
    log(f"model: {model.num_parameters() / 1e6:.2f}M parameters, context {CONTEXT}, stride {STRIDE}")
    results: dict[str, Any] = {}

    def ours() -> None:
        results["lmcli"] = lmcli_perplexity(model, tok, text)

    def theirs() -> None:
        results["hf"] = hf_perplexity(hf, tok, text, CONTEXT, STRIDE)

    with fastpath.inference(model):  # as `lmcli eval` holds it for the whole command
        times = interleaved({"lmcli": ours, "hf": theirs}, repeats=3, warmup=1)
    score: Score = results["lmcli"]
    hf_count, hf_nll = results["hf"]
    if hf_count != score.tokens:
        raise RuntimeError(f"scored token counts differ: lmcli {score.tokens}, HF {hf_count}")
    ppl, hf_ppl = score.perplexity, math.exp(hf_nll / hf_count)
    rel = abs(ppl - hf_ppl) / hf_ppl
    log(f"perplexity: lmcli {ppl:.6f}, HF {hf_ppl:.6f} (relative difference {rel:.1e})")
    same = rel < 1e-5
    return [
        Row(
            f"eval tokens/s, {model.num_parameters() / 1e6:.1f}M, ctx {CONTEXT} stride {STRIDE}",
            "tokens/s",
            score.tokens / times["lmcli"],
            hf_count / times["hf"],
            "HF perplexity-guide loop",
            GOAL,
            valid=same,
            note=f"perplexity lmcli {ppl:.6f}, HF {hf_ppl:.6f}, relative difference {rel:.1e}"
            + ("" if same else " (NOT EQUAL)"),
            extra={
                "perplexity": ppl,
                "hf_perplexity": hf_ppl,
                "relative_difference": rel,
                "tokens": hf_count,
            },
        )
    ]


def main() -> None:
    run_suite("eval", run)


if __name__ == "__main__":
    main()
