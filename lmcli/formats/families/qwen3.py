"""Qwen3: Llama with per-head query/key RMSNorm before the rotary turn (lmcli's ``qk_norm``), a
head size of its own (``head_dim``: 128 for any width), no biases, and Qwen2's sliding window
(``use_sliding_window``; transformers 5's ``layer_types``). llama.cpp's ``qwen3`` turns the halves
of each head as lmcli does: no rows permuted.
"""

from __future__ import annotations

from typing import Any

from lmcli.config.model import ModelConfig
from lmcli.formats.families.adapter import Format, Rename
from lmcli.formats.families.hf_config import HFConfig
from lmcli.formats.families.llama import HF_LAYER, Llama, gguf_names
from lmcli.formats.families.qwen2 import Qwen2

QK_NORMS = (
    Rename("h.{i}.attn.q_norm", HF_LAYER + "self_attn.q_norm"),
    Rename("h.{i}.attn.k_norm", HF_LAYER + "self_attn.k_norm"),
)
GGUF_QK_NORMS = (
    Rename("h.{i}.attn.q_norm", "blk.{i}.attn_q_norm"),
    Rename("h.{i}.attn.k_norm", "blk.{i}.attn_k_norm"),
)


def with_qk_norms(names: tuple, norms: tuple) -> tuple:
    """A Llama-like map with the query/key norms after the block's first entry."""
    first = next(i for i, e in enumerate(names) if "{i}" in e.ours)
    return names[: first + 1] + norms + names[first + 1 :]


class Qwen3(Qwen2):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    gguf_arch = "qwen3"
    export_rank = 40
    qkv_bias = False
    hf_extra = {"attention_bias": False}
    hf_names = with_qk_norms(Llama.hf_names, QK_NORMS)
    gguf_names = with_qk_norms(gguf_names(pairs=False), GGUF_QK_NORMS)
    expresses = Qwen2.expresses | {"qk-norm"}
    gguf_expresses = Llama.gguf_expresses | {"qk-norm"}  # (llama.cpp's qwen3 has no window: capped)
    gguf_head_lengths = True  # as llama.cpp's converter writes them
    gguf_needs = "rotary positions without scaling, pre-RMSNorm, a SwiGLU MLP and qk-norm"

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        return cfg.qk_norm

    def own_settings(self, hf: HFConfig, n_layer: int) -> dict[str, Any]:
        return {"qk_norm": True}

    def gguf_settings(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return super().gguf_settings(meta, shapes) | {"qk_norm": True}

    def own_problems(self, cfg: ModelConfig, fmt: Format) -> list[str]:
        found = super().own_problems(cfg, fmt)
        found += ["query/key/value biases"] if cfg.qkv_bias else []
        return found + ([] if cfg.qk_norm else ["no qk-norm"])
