"""GPT-2 in Hugging Face's layout: config and weights to and from lmcli's.

lmcli's default architecture is GPT-2's, so the conversion is a renaming plus a transpose
(GPT-2 stores its linear layers as ``Conv1D``, weights shaped (in, out)).
"""

from __future__ import annotations

from typing import Any

import torch

from lmcli.checkpoint import logical_state
from lmcli.config import ModelConfig
from lmcli.errors import LmcliError
from lmcli.model import Transformer

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def check_gpt2_compatible(cfg: ModelConfig) -> None:
    """A clear error for configurations GPT-2 cannot express."""
    problems = []
    if cfg.position != "learned":
        problems.append(f"{cfg.position} positions")
    if cfg.norm != "layernorm":
        problems.append(cfg.norm)
    if cfg.norm_placement != "pre":
        problems.append("post-norm")
    if cfg.mlp != "gelu":
        problems.append(f"a {cfg.mlp} MLP")
    if not cfg.tie_embeddings:
        problems.append("untied embeddings")
    if not cfg.bias:
        problems.append("no biases")
    if cfg.n_kv_head != cfg.n_head:
        problems.append("grouped-query attention")
    if cfg.qk_norm:
        problems.append("qk-norm")
    if cfg.logit_softcap:
        problems.append("logit soft-capping")
    if problems:
        raise LmcliError(
            f"GPT-2 cannot express this model ({', '.join(problems)}): export needs learned positions, "
            "pre-LayerNorm, a GELU MLP, tied embeddings and biases"
        )


def hf_config(cfg: ModelConfig, ids: dict[str, int | None], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of our model as a GPT-2 (``ids``: bos/eos/pad token ids)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.ffn_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
        "torch_dtype": dtype,
    }


def to_gpt2_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under GPT-2's names, Conv1D weights transposed (tied head stored once)."""
    out = {}
    for key, value in logical_state(model).items():
        if any(key.endswith(s) for s in _CONV1D):
            value = value.t().contiguous()
        out[f"transformer.{key}" if key != "lm_head.weight" else key] = value
    return out


def from_gpt2_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 weights (with or without the ``transformer.`` prefix) under our names."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("transformer.")
        if key.endswith(("attn.bias", "attn.masked_bias")) and value.dim() > 1:
            continue  # old GPT-2 checkpoints store their causal mask as a buffer
        if any(key.endswith(s) for s in _CONV1D):
            value = value.t().contiguous()
        out[key] = value
    return out


def config_from_hf(hf: dict[str, Any], where: str) -> tuple[ModelConfig, list[str]]:
    """Our ModelConfig of a GPT-2 ``config.json`` (and no notices)."""
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        raise LmcliError(f"{where}: unsupported GPT-2 activation {hf.get('activation_function')!r}")
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        vocab_multiple=1,  # the imported shapes as they are
        block_size=hf.get("n_positions", 1024),
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        d_ff=hf.get("n_inner") or 0,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )
    return cfg, []
