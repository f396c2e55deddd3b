"""Models out: a Hugging Face folder (``hf.py``) or a GGUF file for llama.cpp (``gguf.py``),
from any source ``lmcli.formats.sources`` reads.
"""
