"""GPT-2 in Hugging Face's layout: config and weights to and from lmcli's.

lmcli's default architecture is GPT-2's, so the conversion is a renaming plus a transpose
(GPT-2 stores its linear layers as ``Conv1D``, weights shaped (in, out)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lmcli.checkpoint import DISK_NAMES, load_state, model_state
from lmcli.config import ModelConfig
from lmcli.errors import LmcliError
from lmcli.model import Transformer
from lmcli.tokenizer import Tokenizer

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
    if problems:
        raise LmcliError(
            f"GPT-2 cannot express this model ({', '.join(problems)}): export needs learned positions, "
            "pre-LayerNorm, a GELU MLP, tied embeddings and biases"
        )


def gpt2_config(cfg: ModelConfig, tok: Tokenizer) -> dict[str, Any]:
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
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
    }


def to_gpt2_state(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under GPT-2's names, Conv1D weights transposed (tied head stored once)."""
    out = {}
    for key, value in model_state(model).items():
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


def from_hf_gpt2(path: Path, hf: dict[str, Any]) -> Transformer:
    """The GPT-2 of a local Hugging Face folder (``hf``: its config.json) as our Transformer."""
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        raise LmcliError(f"unsupported GPT-2 activation {hf.get('activation_function')!r}")
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf.get("n_positions", 1024),
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        d_ff=hf.get("n_inner") or 0,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )
    weights = path / "model.safetensors"
    try:
        if weights.exists():
            state = load_file(str(weights))
        elif (path / "pytorch_model.bin").exists():
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise LmcliError(f"{path} has no model.safetensors")
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise LmcliError(f"cannot read weights in {path}: {str(exc).splitlines()[0][:200]}") from None
    model = Transformer(cfg)
    known = {DISK_NAMES.get(k, k) for k in model.state_dict()}  # names as on disk
    load_state(model, {k: v for k, v in from_gpt2_state(state).items() if k in known}, f"in {path}")
    return model
