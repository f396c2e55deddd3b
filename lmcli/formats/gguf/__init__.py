"""GGUF files in: the bounded header scan (``check.py``), tensors and config (``load.py``),
and the vocabulary rebuilt as a tokenizer (``vocab.py``).
"""
