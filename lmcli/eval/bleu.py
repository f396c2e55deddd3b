"""Translation quality with sacreBLEU: BLEU (cased, 13a), lowercased BLEU and chrF; and the greedy
BLEU on validation pairs that training reports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcli.data.examples import ExampleSet
    from lmcli.model.transformer import Transformer
    from lmcli.text.tokenizer import Tokenizer


def score_translations(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus BLEU, lowercased BLEU and chrF of detokenized hypotheses against one reference each."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    bleu_lc = sacrebleu.metrics.BLEU(lowercase=True)
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    lc = bleu_lc.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(b.score, 2),
        "bleu_lowercase": round(lc.score, 2),
        "chrf": round(c.score, 2),
        "sentences": len(hypotheses),
        "signature": str(bleu.get_signature()),
        "summary": f"BLEU {b.score:.2f} (cased, 13a)  BLEU-lc {lc.score:.2f}  chrF {c.score:.2f}  "
        f"on {len(hypotheses)} sentences",
    }


def greedy_bleu(
    model: Transformer,
    tokenizer: Tokenizer,
    pairs: ExampleSet,
    n: int,
    *,
    prefix_lm: bool = False,
    batch_size: int = 32,
) -> dict[str, Any]:
    """BLEU and chrF of greedy translations of the first ``n`` tokenized pairs.

    The prompt is each pair's own ``<bos> source <sep>`` and the reference its detokenized target,
    so no text is re-read; at most 1.5 × source tokens + 10 new tokens, as ``lmcli beam`` advises.
    """
    from lmcli.config.commands import BeamConfig
    from lmcli.generate.beam import beam_search

    cfg = BeamConfig(beam_size=1, max_new_tokens=model.config.block_size, max_len_a=1.5, max_len_b=10)
    hyps: list[str] = []
    refs: list[str] = []
    was_training = model.training
    model.eval()
    for start in range(0, min(n, len(pairs)), batch_size):
        indices = range(start, min(start + batch_size, n, len(pairs)))
        seqs = [pairs.sequence(i).tolist() for i in indices]
        cut = [int(pairs.prefix[i]) for i in indices]
        prompts = [s[:p] for s, p in zip(seqs, cut, strict=True)]
        best = beam_search(
            model,
            prompts,
            cfg,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            input_lens=[p - 2 for p in cut],
            prefix_lm=prefix_lm,
        )
        hyps.extend(tokenizer.decode(h[0].ids) for h in best)
        refs.extend(tokenizer.decode(s[p:]) for s, p in zip(seqs, cut, strict=True))
    model.train(was_training)
    return score_translations(hyps, refs)
