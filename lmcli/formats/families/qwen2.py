"""Qwen2: Llama with biases on the query, key and value projections (lmcli's ``qkv_bias``).

Its ``use_sliding_window`` caps the context as Mistral's window does. llama.cpp's ``qwen2`` turns
the halves of each head as lmcli does, so its GGUF map permutes no rows (lmcli's GGUF export
writes such models as ``llama``, which reads the biases too; this map is for reading).
"""

from __future__ import annotations

from lmcli.formats.families.llama import Llama, gguf_names


class Qwen2(Llama):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    gguf_arch = "qwen2"
    qkv_bias = True
    hf_extra = {"use_sliding_window": False, "sliding_window": None}
    gguf_names = gguf_names(pairs=False)
