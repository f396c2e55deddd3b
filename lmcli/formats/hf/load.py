"""A local Hugging Face model folder in: its family's config and weights, its tokenizer.

The family adapter (``lmcli.formats.families``) that the folder's ``config.json`` names maps its config
and its weights' names to lmcli's; ``weights.py`` reads the (sharded) safetensors without copies
and builds the model around them. ``transformers`` is not needed (only the tests use it).

The special tokens of an imported model come from its folder: ``tokenizer_config.json`` first
(``bos_token``, ``eos_token``, ``pad_token``, and its ``chat_template``), then the token ids of
``generation_config.json`` and ``config.json``; they travel with the tokenizer from then on.
Whether a text starts with ``<bos>``: the config's ``add_bos_token`` when it says, else what
``tokenizer.json``'s post-processor does (what ``transformers`` adds by default).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import JSON_LIMIT
from lmcli.formats.families import FamilyAdapter, HFConfig, from_hf_config
from lmcli.formats.hf.weights import (
    LAYER,
    as_dtype,
    build_model,
    check_weights,
    is_pytorch_bin,
    read_headers,
    read_weights,
    weight_files,
)
from lmcli.formats.weights import read_tensors
from lmcli.model.transformer import Transformer
from lmcli.safe_io import read_json_object
from lmcli.text.tokenizer import Tokenizer, read_config, read_flags


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def is_hf_folder(path: str | Path) -> bool:
    """A Hugging Face model folder (config.json with a model_type), not an lmcli checkpoint."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file() or (path / "meta.json").exists() or config.stat().st_size > JSON_LIMIT:
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "model_type" in data


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file (at most ``JSON_LIMIT`` bytes); {} when it does not exist."""
    return read_json_object(path, JSON_LIMIT)


def read_tokenizer(path: Path, hf: HFConfig | None = None) -> Tokenizer:
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
    generation = path / "generation_config.json"
    for source in (HFConfig(read_json(generation), str(generation)), hf or HFConfig({}, "")):
        for role in ("bos", "eos", "pad"):
            i = source.get(f"{role}_token_id")
            i = i[0] if isinstance(i, list) and i else i  # several end tokens: the first is lmcli's eos
            if role not in specials and isinstance(i, int) and tok.id_to_token(i) is not None:
                specials[role] = tok.id_to_token(i)
    add_bos, add_eos = read_flags(path / "tokenizer_config.json")
    try:
        out = Tokenizer(tok, specials, template, add_eos=bool(add_eos))
    except LmcliError as exc:
        raise LmcliError(f"{path}: {exc}") from None
    out.add_bos = add_bos if add_bos is not None else adds_bos(out)
    return out


def adds_bos(tok: Tokenizer) -> bool:
    """Whether the tokenizer's own post-processor puts ``<bos>`` before a text."""
    probe = tok.hf.encode("a", add_special_tokens=True).ids
    return bool(probe) and probe[0] == tok.bos_id and tok.bos_id not in tok.encode("a")


def read_hf_config(path: Path) -> tuple[HFConfig, FamilyAdapter, ModelConfig, list[str]]:
    """A folder's ``config.json``: the config, its family, lmcli's ModelConfig of it (every value
    checked, ``HFConfig``) and notices; one line naming the file for what does not fit."""
    hf = HFConfig(read_json(path / "config.json"), str(path / "config.json"))
    family = from_hf_config(hf)
    try:
        cfg, notices = family.config_from_hf(hf)
    except LmcliError as exc:
        message = str(exc)
        raise LmcliError(message if message.startswith(hf.where) else f"{hf.where}: {message}") from None
    return hf, family, cfg, notices


@dataclass
class HFFolder:
    """A Hugging Face folder opened without its weights: its family, model config and tokenizer."""

    path: Path
    family: FamilyAdapter
    config: ModelConfig
    tokenizer: Tokenizer
    notices: list[str]


def open_hf_folder(path: str | Path) -> HFFolder:
    """A local Hugging Face model folder's config and tokenizer, its weights' headers checked
    against the config (the weights are not read)."""
    path = Path(path)
    if not path.is_dir():
        raise LmcliError(f"no such Hugging Face model folder: {path}")
    hf, family, cfg, notices = read_hf_config(path)
    tok = read_tokenizer(path, hf)
    if tok.vocab_size > cfg.vocab_size:
        raise LmcliError(f"tokenizer in {path} has {tok.vocab_size} tokens, the model {cfg.vocab_size}")
    check_weights(family, cfg, read_headers(path), path)  # before anything of the config's size
    return HFFolder(path, family, cfg, tok, notices)


def read_blocks(folder: HFFolder, dtype: torch.dtype) -> Iterator[dict[str, Tensor]]:
    """The folder's weights under lmcli's names (as on disk) in ``dtype``: those of no block
    first (the embeddings, the final norm, an untied head), then one Transformer block at a
    time: a reader that keeps only a slice of each (a sharded model's rows) never holds more
    than one block's whole tensors. Each is read into memory of its own (``read_tensors``), not
    through a map of the file, whose pages, once read, would stay resident (and counted) until
    the last block: the whole file, at the end."""
    groups: dict[int | None, list[str]] = {}
    files = weight_files(folder.path) if not is_pytorch_bin(folder.path) else []
    keys: dict[Path, set[str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:  # checks the header and its offsets
                keys[file] = set(f.keys())
        except (SafetensorError, OSError) as exc:
            raise LmcliError(f"cannot read weights {file}: {str(exc).splitlines()[0][:200]}") from None
    whole = read_weights(folder.path, dtype) if not files else {}
    for key in [*(k for names in keys.values() for k in names), *whole]:
        found = LAYER.search(key)
        groups.setdefault(int(found.group(1)) if found else None, []).append(key)
    for _, names in sorted(groups.items(), key=lambda item: (item[0] is not None, item[0] or 0)):
        state = {k: as_dtype(whole[k], dtype) for k in names if k in whole}
        for file, held in keys.items():
            wanted = held.intersection(names)
            if wanted:
                try:
                    state.update(read_tensors(file, dtype, wanted))
                except (OSError, ValueError) as exc:
                    why = str(exc).splitlines()[0][:200]
                    raise LmcliError(f"cannot read weights {file}: {why}") from None
        yield folder.family.from_hf(state, folder.config)


def load_hf_folder(
    path: str | Path, dtype: torch.dtype | None = None, info: Callable[[str], None] = _stderr
) -> tuple[Transformer, Tokenizer]:
    """A local Hugging Face model folder as our Transformer (eval mode, weights in ``dtype``;
    None: as stored) and Tokenizer. ``info`` receives notices (e.g. a capped context)."""
    folder = open_hf_folder(path)
    path, family, cfg, tok = folder.path, folder.family, folder.config, folder.tokenizer
    state = read_weights(path, dtype)
    if dtype is None:  # as stored; a few tensors stored otherwise follow the embeddings
        dtype = next((v.dtype for k, v in state.items() if "embed" in k or "wte" in k), None)
        state = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in state.items()}
    model = build_model(cfg, family.from_hf(state, cfg), f"in {path}")
    for note in folder.notices:
        info(f"warning: {path}: {note}")
    return model, tok
