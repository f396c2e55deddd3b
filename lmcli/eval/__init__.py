"""How good a model is.

- ``perplexity.py``: perplexity and bits per byte on held-out text (``lmcli eval``);
- ``bleu.py``: BLEU and chrF of translations;
- ``downstream/``: downstream benchmarks (multiple choice, cloze, generation) from local files;
- ``harness/``: lmcli as an lm-evaluation-harness backend.
"""
