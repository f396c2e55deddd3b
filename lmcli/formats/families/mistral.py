"""Mistral: Llama with a sliding attention window on every layer (lmcli's ``sliding_window``: a
local layer attends to the last W positions, and its cache keeps no more). llama.cpp stores
Mistral models as ``llama``: the Llama adapter reads such files, with the same map.
"""

from __future__ import annotations

from typing import Any

from lmcli.config.model import ModelConfig
from lmcli.formats.families.adapter import Format
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.families.llama import Llama


class Mistral(Llama):
    name = "mistral"
    architecture = "MistralForCausalLM"
    export_rank = 60
    hf_extra = {}
    expresses = Llama.expresses | {"a sliding window"}

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return fmt == "hf" and bool(cfg.sliding_window)  # (GGUF: llama, the context capped)

    def window(self, hf: HFConfig) -> int | None:
        return hf.get("sliding_window")

    def window_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": cfg.sliding_window or None}
