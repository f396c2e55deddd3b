"""Translation quality with sacreBLEU: BLEU (cased, 13a), lowercased BLEU and chrF."""

from __future__ import annotations

from typing import Any


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
