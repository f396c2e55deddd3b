"""Llama, Qwen2 and Mistral in Hugging Face's layout: config and weights to and from lmcli's.

All three are lmcli's ``--position rope --norm rmsnorm --mlp swiglu --no-bias`` model with
separate query, key and value projections (lmcli keeps them as one fused ``c_attn``, q then k
then v, so the conversion concatenates or splits them). Qwen2 adds biases to those three
projections (``qkv_bias``); Mistral adds a sliding attention window, honoured by capping the
context at the window (exact for every sequence that fits in it). Hugging Face's Llama already
uses the rotate-half layout of the rotary embedding, as lmcli does, so no weight is permuted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lmcli.config import ModelConfig
from lmcli.errors import LmcliError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# rope_scaling keys lmcli reads, by scaling type (any other key with a value is refused)
_ROPE_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"},
}
_LAYER = {  # our name in block i -> Hugging Face's in model.layers.i
    "ln_1.weight": "input_layernorm.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_gate.weight": "mlp.gate_proj.weight",
    "mlp.c_fc.weight": "mlp.up_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")


def rope_settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our rope fields from a config's ``rope_theta``/``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5); an unsupported scaling type is refused."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_base": float(theta)}
    if kind in ("default", None):
        return out
    if kind not in _ROPE_KEYS:
        raise LmcliError(
            f"{where}: unsupported rope_scaling type {kind!r} (lmcli implements linear, llama3 and yarn)"
        )
    extra = (
        {k for k, v in scaling.items() if v is not None}
        - _ROPE_KEYS[kind]
        - {"rope_type", "type", "rope_theta"}
    )
    if kind == "yarn" and (
        scaling.get("beta_fast", 32) != 32
        or scaling.get("beta_slow", 1) != 1
        or not scaling.get("truncate", True)
    ):
        extra.add("beta_fast/beta_slow/truncate")
    if extra:
        raise LmcliError(f"{where}: unsupported rope_scaling field(s) {', '.join(sorted(extra))} for {kind}")
    out.update(rope_scaling=kind, rope_factor=float(scaling["factor"]))
    if kind in ("llama3", "yarn"):
        out["rope_original_context"] = int(scaling["original_max_position_embeddings"])
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
        )
    return out


def config_from_hf(hf: dict[str, Any], where: str) -> tuple[ModelConfig, list[str]]:
    """Our ModelConfig of a Llama/Qwen2/Mistral ``config.json``, and notices to show the user."""
    kind = hf["model_type"]
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, width // heads) or width % heads:
        raise LmcliError(f"{where}: head_dim {hf.get('head_dim')} is not hidden_size / num_attention_heads")
    if hf.get("hidden_act", "silu") != "silu":
        raise LmcliError(
            f"{where}: unsupported hidden_act {hf.get('hidden_act')!r} (lmcli's SwiGLU uses silu)"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise LmcliError(f"{where}: attention_bias/mlp_bias are not supported for {kind}")
    notices = []
    context = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if (kind == "mistral" or hf.get("use_sliding_window")) else None
    if window and window < context:
        notices.append(f"context capped at the sliding window of {window} tokens (of {context})")
        context = window
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        vocab_multiple=1,  # the imported shapes as they are
        block_size=context,
        n_layer=hf["num_hidden_layers"],
        n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads,
        n_embd=width,
        d_ff=hf["intermediate_size"],
        bias=False,
        qkv_bias=kind == "qwen2",
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        **rope_settings(hf, where),
    )
    return cfg, notices


def from_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face weights under our names: q, k and v concatenated into ``c_attn``."""
    state = dict(state)
    out = {}
    for i in range(cfg.n_layer):
        hf = f"model.layers.{i}."
        for ours, theirs in _LAYER.items():
            if hf + theirs in state:
                out[f"h.{i}.{ours}"] = state.pop(hf + theirs)
        for part in ("weight", "bias"):
            names = [f"{hf}self_attn.{p}.{part}" for p in _QKV]
            if all(n in state for n in names):
                out[f"h.{i}.attn.c_attn.{part}"] = torch.cat([state.pop(n) for n in names])
        state.pop(hf + "self_attn.rotary_emb.inv_freq", None)  # a buffer some old checkpoints kept
    for ours, theirs in (("wte.weight", "model.embed_tokens.weight"), ("ln_f.weight", "model.norm.weight")):
        if theirs in state:
            out[ours] = state.pop(theirs)
    out.update(state)  # lm_head.weight, and whatever is left over (reported as unexpected)
    return out


def check_llama_compatible(cfg: ModelConfig) -> str:
    """``llama``, or ``qwen2`` when the query/key/value projections have biases; a one-line
    error naming what neither expresses."""
    problems = []
    if cfg.position != "rope":
        problems.append(f"{cfg.position} positions")
    if cfg.norm != "rmsnorm":
        problems.append(cfg.norm)
    if cfg.norm_placement != "pre":
        problems.append("post-norm")
    if cfg.mlp != "swiglu":
        problems.append(f"a {cfg.mlp} MLP")
    if cfg.bias:
        problems.append("biases outside the query/key/value projection")
    if cfg.qk_norm:
        problems.append("qk-norm")
    if cfg.logit_softcap:
        problems.append("logit soft-capping")
    if problems:
        raise LmcliError(
            f"no Hugging Face family expresses this model ({', '.join(problems)}): GPT-2 needs learned "
            "positions, pre-LayerNorm, a GELU MLP and biases; Llama/Qwen2 need rope, pre-RMSNorm, "
            "SwiGLU and no biases (Qwen2: query/key/value biases only)"
        )
    return "qwen2" if cfg.qkv_bias else "llama"


def hf_config(cfg: ModelConfig, kind: str, ids: dict[str, int | None], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of our model as a Llama or Qwen2 (``ids``: bos/eos/pad token ids)."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.block_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": rope_scaling_dict(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": dtype,
    }
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def rope_scaling_dict(cfg: ModelConfig) -> dict[str, Any] | None:
    """``rope_scaling`` as Hugging Face configs write it (None: no scaling)."""
    if cfg.rope_scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = cfg.rope_original_context
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    return out


def to_hf_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our weights (names as on disk, tied head absent) under Hugging Face's names."""
    sizes = [cfg.n_embd, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim]
    out = {}
    for key, value in state.items():
        if key == "wte.weight":
            out["model.embed_tokens.weight"] = value
        elif key == "ln_f.weight":
            out["model.norm.weight"] = value
        elif key == "lm_head.weight":
            out[key] = value
        else:
            _, i, rest = key.split(".", 2)  # h.{i}.{rest}
            hf = f"model.layers.{i}."
            if rest.startswith("attn.c_attn."):
                part = rest.rsplit(".", 1)[1]
                for name, piece in zip(_QKV, value.split(sizes), strict=True):
                    out[f"{hf}self_attn.{name}.{part}"] = piece.contiguous()
            else:
                out[hf + _LAYER[rest]] = value
    return out
