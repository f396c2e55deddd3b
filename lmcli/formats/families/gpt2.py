"""GPT-2: lmcli's default model (learned positions, pre-LayerNorm, tanh-GELU, biases, tied head).

Hugging Face's ``GPT2LMHeadModel`` keeps lmcli's names under ``transformer.`` and stores its
linear layers as ``Conv1D``, weights shaped (in, out): those are transposed both ways. llama.cpp's
``gpt2`` keeps the fused query/key/value projection and also takes an untied head and grouped-query
attention, which Hugging Face's GPT-2 does not.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families.adapter import GGUF_BLOCK, GGUF_HEAD, FamilyAdapter, Field, Format, Rename
from lmcli.formats.families.hf_config import HFConfig

_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_BLOCK = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2(FamilyAdapter):
    name = "gpt2"
    architecture = "GPT2LMHeadModel"
    gguf_arch = "gpt2"
    export_rank = 10
    position, norm, mlp = "learned", "layernorm", "gelu"
    hf_names = (
        *(Rename(m, f"transformer.{m}") for m in ("wte", "wpe", "ln_f")),
        Rename("lm_head", "lm_head"),
        *(Rename(f"h.{{i}}.{m}", f"transformer.h.{{i}}.{m}", transpose=m in _CONV1D) for m in _BLOCK),
    )
    hf_fields = (
        Field("n_positions", "block_size", 1024),
        Field("n_embd", "n_embd"),
        Field("n_layer", "n_layer"),
        Field("n_head", "n_head"),
        Field("n_inner", "d_ff", None),
        Field("layer_norm_epsilon", "norm_eps", 1e-5),
    )
    hf_buffers = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)  # old checkpoints' causal masks
    gguf_names = (
        Rename("wte", "token_embd"),
        Rename("wpe", "position_embd"),
        *GGUF_BLOCK,
        Rename("h.{i}.attn.c_attn", "blk.{i}.attn_qkv"),
        *GGUF_HEAD,
    )
    hf_refusal = (
        "GPT-2 cannot express this model ({}): export needs learned positions, "
        "pre-LayerNorm, a GELU MLP, tied embeddings and biases"
    )
    gguf_needs = "learned positions, pre-LayerNorm, a GELU MLP and biases"

    def claims(self, cfg: ModelConfig, fmt: Format) -> bool:
        # GGUF's gpt2 takes every model without rotary positions (and names what it cannot hold)
        return cfg.position == "learned" if fmt == "hf" else cfg.position != "rope"

    def own_problems(self, cfg: ModelConfig, fmt: Format) -> list[str]:
        found = []
        if fmt == "hf" and not cfg.tie_embeddings:
            found.append("untied embeddings")
        if not cfg.bias:
            found.append("no biases")
        if fmt == "hf" and cfg.n_kv_head != cfg.n_head:
            found.append("grouped-query attention")
        return found

    def config_from_hf(self, hf: HFConfig) -> tuple[ModelConfig, list[str]]:
        activation = hf.get("activation_function", "gelu_new")
        if activation not in _GELU_TANH:
            raise LmcliError(f"{hf.where}: unsupported GPT-2 activation {activation!r}")
        fields = self.read_fields(hf)
        fields["d_ff"] = fields["d_ff"] or 0  # null: GPT-2's 4 x n_embd, lmcli's default
        return ModelConfig(**fields, vocab_multiple=1), []  # vocab_multiple: the shapes as they are

    def hf_settings(self, cfg: ModelConfig) -> dict[str, Any]:
        dropouts = {f"{where}_pdrop": cfg.dropout for where in ("resid", "embd", "attn")}
        return {
            "activation_function": "gelu_new",
            **dropouts,
            "tie_word_embeddings": True,
            "scale_attn_weights": True,
        }

    def from_hf(self, state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """GPT-2 weights, with or without the ``transformer.`` prefix, under lmcli's names."""
        prefixed = ("transformer.", "lm_head.")
        return super().from_hf(
            {k if k.startswith(prefixed) else f"transformer.{k}": v for k, v in state.items()}, cfg
        )

    def gguf_metadata(self, writer: Any, cfg: ModelConfig) -> None:
        writer.add_layer_norm_eps(cfg.norm_eps)

    def gguf_settings(self, meta: HFConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return {"norm_eps": meta.get("gpt2.attention.layer_norm_epsilon", 1e-5), "bias": True}
