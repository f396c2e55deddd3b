"""Hugging Face interop: load a local model folder, export an lmcli checkpoint as one.

Families: ``gpt2.py`` (GPT2LMHeadModel) and ``llama.py`` (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM) each hold a config and weight mapping both ways; ``weights.py`` reads
(sharded) safetensors without copies and builds the model around them. Neither direction needs
``transformers``; only the tests use it, to check that logits and generations agree.

The special tokens of an imported model come from its folder: ``tokenizer_config.json`` first
(``bos_token``, ``eos_token``, ``pad_token``, and its ``chat_template``), then the token ids of
``generation_config.json`` and ``config.json``; they travel with the tokenizer from then on.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lmcli.checkpoint import load_model, logical_state
from lmcli.config import ModelConfig
from lmcli.errors import LmcliError
from lmcli.hf import gpt2, llama
from lmcli.hf.weights import build_model, read_weights
from lmcli.model import Transformer
from lmcli.safe_io import temp_dir
from lmcli.tokenizer import Tokenizer, read_config

# model_type -> (its config.json as our ModelConfig, its weights under our names)
IMPORTERS: dict[str, tuple[Callable[..., tuple[ModelConfig, list[str]]], Callable[..., dict]]] = {
    "gpt2": (gpt2.config_from_hf, lambda state, cfg: gpt2.from_gpt2_state(state)),
    "llama": (llama.config_from_hf, llama.from_hf_state),
    "qwen2": (llama.config_from_hf, llama.from_hf_state),
    "mistral": (llama.config_from_hf, llama.from_hf_state),
}
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", **{arch: kind for kind, arch in llama.ARCHITECTURES.items()}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder (config.json with a model_type), not an lmcli checkpoint."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "meta.json").exists():
        return False
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except ValueError:
        return False


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; {} when it does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LmcliError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise LmcliError(f"{path} does not hold a JSON object")
    return data


def family_of(hf: dict[str, Any], where: str) -> str:
    """``gpt2``, ``llama``, ``qwen2`` or ``mistral``; one line naming an architecture lmcli lacks."""
    archs = hf.get("architectures") or []
    kind = hf.get("model_type")
    if kind in IMPORTERS and all(ARCHITECTURES.get(a) == kind for a in archs):
        return kind
    name = next((a for a in archs if a not in ARCHITECTURES), None) or kind
    raise LmcliError(f"{where}: unsupported architecture {name!r} (lmcli imports {', '.join(ARCHITECTURES)})")


def read_tokenizer(path: Path, hf: dict[str, Any] | None = None) -> Tokenizer:
    """The folder's tokenizer with the special tokens the folder names (see the module doc)."""
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise LmcliError(f"cannot read tokenizer {path / 'tokenizer.json'}: {str(exc)[:200]}") from None
    elif (path / "vocab.json").exists() and (path / "merges.txt").exists():
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        tok = HFTokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        raise LmcliError(f"{path} has no tokenizer.json (or vocab.json + merges.txt)")
    specials, template = read_config(path / "tokenizer_config.json")
    for source in (read_json(path / "generation_config.json"), hf or {}):
        for role in ("bos", "eos", "pad"):
            i = source.get(f"{role}_token_id")
            i = i[0] if isinstance(i, list) and i else i  # several end tokens: the first is lmcli's eos
            if role not in specials and isinstance(i, int) and tok.id_to_token(i) is not None:
                specials[role] = tok.id_to_token(i)
    try:
        return Tokenizer(tok, specials, template)
    except LmcliError as exc:
        raise LmcliError(f"{path}: {exc}") from None


def load_hf_folder(
    path: str | Path, dtype: torch.dtype | None = None, info: Callable[[str], None] = _stderr
) -> tuple[Transformer, Tokenizer]:
    """A local Hugging Face model folder as our Transformer (eval mode, weights in ``dtype``;
    None: as stored) and Tokenizer. ``info`` receives notices (e.g. a capped context)."""
    path = Path(path)
    if not path.is_dir():
        raise LmcliError(f"no such Hugging Face model folder: {path}")
    hf = read_json(path / "config.json")
    kind = family_of(hf, str(path / "config.json"))
    to_config, to_state = IMPORTERS[kind]
    try:
        cfg, notices = to_config(hf, str(path / "config.json"))
    except KeyError as exc:
        raise LmcliError(f"{path / 'config.json'} has no {exc.args[0]}") from None
    tok = read_tokenizer(path, hf)
    if tok.vocab_size > cfg.vocab_size:
        raise LmcliError(f"tokenizer in {path} has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    state = read_weights(path, dtype)
    if dtype is None:  # as stored; a few tensors stored otherwise follow the embeddings
        dtype = next((v.dtype for k, v in state.items() if "embed" in k or "wte" in k), None)
        state = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in state.items()}
    model = build_model(cfg, to_state(state, cfg), f"in {path}")
    for note in notices:
        info(f"warning: {path}: {note}")
    return model, tok


# ----------------------------------------------------------------------------- export


def export_family(cfg: ModelConfig) -> str:
    """The Hugging Face family that expresses ``cfg``: GPT-2 for learned positions, else Llama
    (Qwen2 with query/key/value biases); one line naming what does not fit."""
    if cfg.position == "learned":
        gpt2.check_gpt2_compatible(cfg)
        return "gpt2"
    return llama.check_llama_compatible(cfg)


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Write a folder that ``transformers`` AutoModelForCausalLM/AutoTokenizer load, from an lmcli
    run or checkpoint folder (or a Hugging Face folder lmcli imports)."""
    ckpt = load_model(path)
    cfg, tok, model = ckpt.model_config, ckpt.tokenizer, ckpt.model
    kind = export_family(cfg)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise LmcliError(f"{out_dir} already holds files: choose an empty or new folder")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    if kind == "gpt2":
        config, state = gpt2.hf_config(cfg, ids, dtype), gpt2.to_gpt2_state(model)
    else:
        config, state = llama.hf_config(cfg, kind, ids, dtype), llama.to_hf_state(logical_state(model), cfg)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out_dir)  # created exclusively: a link planted beside the output is never followed
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {**{f"{r}_token_id": i for r, i in ids.items()}})
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(tmp / "tokenizer.json")
        specials = {f"{role}_token": tok.token(i) for role, i in ids.items()}
        for role, i in (("unk", tok.unk_id), ("sep", tok.sep_id)):
            if i is not None:
                specials[f"{role}_token"] = tok.token(i)
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.block_size,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
            **specials,
        }
        if tok.chat_template is not None:
            tok_cfg["chat_template"] = tok.chat_template
        _write_json(tmp / "tokenizer_config.json", tok_cfg)
        _write_json(tmp / "special_tokens_map.json", specials)
        os.chmod(tmp, out_dir.parent.stat().st_mode & 0o777)  # not mkdtemp's 0700
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
