"""Hugging Face interop: export a checkpoint as a GPT-2 folder, and load a local GPT-2 folder.

lmcli's default architecture is GPT-2's, so the conversion is a renaming plus a transpose
(GPT-2 stores its linear layers as ``Conv1D``, weights shaped (in, out)). Neither direction
needs ``transformers``; only the tests use it, to check that logits agree.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmcli.checkpoint import Checkpoint, load_checkpoint, model_state, resolve_checkpoint
from lmcli.config import ModelConfig, TrainConfig
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


def _atomic_dir(dest: Path) -> Path:
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write a folder that ``transformers`` AutoModelForCausalLM/AutoTokenizer load."""
    ckpt = load_checkpoint(path)
    check_gpt2_compatible(ckpt.model_config)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise LmcliError(f"{out_dir} already holds files: choose an empty or new folder")
    tok = ckpt.tokenizer
    tmp = _atomic_dir(out_dir)
    try:
        (tmp / "config.json").write_text(json.dumps(gpt2_config(ckpt.model_config, tok), indent=2) + "\n")
        save_file(to_gpt2_state(ckpt.model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(tmp / "tokenizer.json")
        vocab = tok.hf.get_vocab(with_added_tokens=True)
        names = {i: t for t, i in vocab.items()}
        specials = {
            "bos_token": names[tok.bos_id],
            "eos_token": names[tok.eos_id],
            "pad_token": names[tok.pad_id],
        }
        if tok.unk_id is not None:
            specials["unk_token"] = names[tok.unk_id]
        if tok.sep_id is not None:
            specials["sep_token"] = names[tok.sep_id]
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": ckpt.model_config.block_size,
            "clean_up_tokenization_spaces": False,
            **specials,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder (config.json with a model_type), not an lmcli checkpoint."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "meta.json").exists():
        return False
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except ValueError:
        return False


def _hf_tokenizer(path: Path) -> Tokenizer:
    if (path / "tokenizer.json").exists():
        return Tokenizer.load(path / "tokenizer.json")
    if (path / "vocab.json").exists() and (path / "merges.txt").exists():
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        tok = HFTokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return Tokenizer(tok)
    raise LmcliError(f"{path} has no tokenizer.json (or vocab.json + merges.txt)")


def from_hf_gpt2(path: str | Path) -> tuple[Transformer, Tokenizer]:
    """Load a local Hugging Face GPT-2 folder as our Transformer and Tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise LmcliError(f"no such Hugging Face model folder: {path}")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LmcliError(f"cannot read {path / 'config.json'}: {exc}") from None
    if hf.get("model_type") != "gpt2":
        raise LmcliError(f"{path} holds a {hf.get('model_type')!r} model; only GPT-2 can be imported")
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
    state = from_gpt2_state(state)
    state.setdefault("lm_head.weight", state.get("wte.weight"))
    model = Transformer(cfg)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise LmcliError(f"weights in {path} lack {', '.join(missing[:3])}")
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    tok = _hf_tokenizer(path)
    if tok.vocab_size > cfg.vocab_size:
        raise LmcliError(f"tokenizer in {path} has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    return model, tok


def load_any(path: str | Path, device: torch.device | str = "cpu") -> Checkpoint:
    """An lmcli run/checkpoint folder, or a local Hugging Face GPT-2 folder."""
    if is_hf_folder(path):
        model, tok = from_hf_gpt2(path)
        model.to(device).eval()
        return Checkpoint(Path(path), model, model.config, TrainConfig(), tok, {"source": "huggingface"})
    return load_checkpoint(resolve_checkpoint(path), device)
