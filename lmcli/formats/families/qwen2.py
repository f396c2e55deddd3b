"""Qwen2: Llama with biases on the query, key and value projections (lmcli's ``qkv_bias``).

With ``use_sliding_window`` the layers from ``max_window_layers`` on attend through the window
(transformers 5 lists them in ``layer_types``). llama.cpp's ``qwen2`` turns the halves of each
head as lmcli does, so its GGUF map permutes no rows (lmcli's GGUF export writes such models as
``llama``, which reads the biases too; this map is for reading).
"""

from __future__ import annotations

from typing import Any

from lmcli.config.model import ModelConfig
from lmcli.formats.families.adapter import GLOBAL, LOCAL, Format, layer_types
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.families.llama import Llama, gguf_names


class Qwen2(Llama):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    gguf_arch = "qwen2"
    export_rank = 50
    qkv_bias = True
    hf_extra = {}
    gguf_names = gguf_names(pairs=False)
    expresses = Llama.expresses | {"a sliding window", "a layer pattern"}

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return fmt == "hf" and bool(cfg.qkv_bias or cfg.layer_pattern)  # (GGUF: llama reads biases)

    def window(self, hf: HFConfig) -> int | None:
        return hf.get("sliding_window") if hf.get("use_sliding_window") else None

    def default_layer_types(self, hf: HFConfig, n_layer: int, window: int) -> list[str]:
        first = hf.get("max_window_layers", 28)
        return [LOCAL if i >= first else GLOBAL for i in range(n_layer)]

    def window_config(self, cfg: ModelConfig) -> dict[str, Any]:
        if not cfg.sliding_window:
            return {"use_sliding_window": False, "sliding_window": None}
        return {
            "use_sliding_window": True,
            "sliding_window": cfg.sliding_window,
            "max_window_layers": 0,
            "layer_types": layer_types(cfg),
        }
