"""Mistral: Llama with a sliding attention window, honoured by capping the context at the window
(exact for every sequence that fits in it; a notice says so). llama.cpp stores Mistral models as
``llama``: the Llama adapter reads such files, with the same map.
"""

from __future__ import annotations

from lmcli.formats.families.llama import Llama


class Mistral(Llama):
    name = "mistral"
    architecture = "MistralForCausalLM"
    windowed = True
    hf_extra = {"sliding_window": None}
