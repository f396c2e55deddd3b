"""GGUF export: an lmcli checkpoint as one file that llama.cpp, and the tools built on it, run.

The file is written with ``gguf``, the llama.cpp project's own Python package: its metadata keys,
file layout and Q8_0 quantization. The architecture, its own metadata and the tensor names come
from the family adapter (``lmcli.hf.families``); this module writes the file and the tokenizer.

Two GGUF architectures express lmcli models:

- ``gpt2``: learned positions, pre-LayerNorm, the tanh-GELU MLP, biases everywhere (llama.cpp
  requires them); tied or untied head, any number of key/value heads;
- ``llama``: rotary positions, pre-RMSNorm, the SwiGLU MLP; biases optional (llama.cpp reads
  them where present), tied or untied head, any number of key/value heads.

Rotary layout: lmcli turns the two halves of each head against each other (``rotate_half``, as
Hugging Face's Llama does); llama.cpp's ``llama`` turns adjacent pairs. The Llama adapter's map
reorders the query and key rows of each head so that llama.cpp's pair (2i, 2i+1) holds lmcli's
pair (i, i + D/2). Attention scores do not change: queries and keys move together.

Tokenizer: lmcli's byte-level BPE is GGUF's ``gpt2`` tokenizer model with GPT-2's pre-tokenizer
(``gpt-2``). The byte tokenizer is the same model with no merges; since llama.cpp requires the
merges key and ``gguf`` cannot write an empty array, it gets one inert merge of two special
tokens (a pair no text can produce, as merges only join byte-level pieces). The char tokenizer
maps whole characters to ids and unknown characters to ``<unk>``: no GGUF tokenizer model does
that, so it is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmcli.checkpoint import logical_state
from lmcli.config import ModelConfig
from lmcli.errors import LmcliError
from lmcli.hf.families import for_export
from lmcli.safe_io import temp_file, write_error
from lmcli.sources import load_checkpoint
from lmcli.tokenizer import Tokenizer

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
Q8_BLOCK = 32  # values per Q8_0 (and Q4_0) block: a matrix whose rows are not a multiple stays f16
VOCABULARY_TENSORS = ("token_embd.weight", "output.weight")  # q8_0 in a q4_0 file, as lmcli's int4 keeps them


def _gguf() -> Any:
    """The ``gguf`` package, or a one-line error saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise LmcliError("GGUF export needs the gguf package: pip install gguf") from None
    return gguf


# ----------------------------------------------------------------------------- the tensors


def encode_tensor(t: torch.Tensor, dtype: str) -> tuple[np.ndarray, Any]:
    """(data, raw GGML type or None) of one tensor in ``dtype``.

    Vectors (norms, biases) stay f32, as in llama.cpp's own converter; with q8_0, a matrix whose
    rows are not a multiple of 32 values is written f16.
    """
    gguf = _gguf()
    data = t.detach().cpu().float().numpy()
    if data.ndim == 1 or dtype == "f32":
        return data, None
    if dtype in ("q8_0", "q4_0") and data.shape[-1] % Q8_BLOCK == 0:
        qtype = gguf.GGMLQuantizationType.Q8_0 if dtype == "q8_0" else gguf.GGMLQuantizationType.Q4_0
        return gguf.quants.quantize(data, qtype), qtype
    return data.astype(np.float16), None


# ----------------------------------------------------------------------------- the tokenizer


@dataclass
class GgufVocab:
    """A tokenizer as GGUF's ``gpt2`` tokenizer model sees it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    special_ids: dict[str, int]  # bos, eos, pad, unk, sep


def _merge_text(merge: str | list[str]) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def gguf_vocab(tok: Tokenizer, vocab_size: int) -> GgufVocab:
    """GGUF tokenizer metadata for lmcli's byte-level BPE and byte tokenizers (others refused).

    ``vocab_size``: the model's; ids the tokenizer does not use are filled with unused tokens.
    """
    gguf = _gguf()
    spec = json.loads(tok.to_json())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") == "WordLevel":
        raise LmcliError(
            "GGUF cannot express lmcli's char tokenizer (whole characters, unknown ones to <unk>): "
            "train with --tokenizer byte or bpe to export GGUF"
        )
    byte_level = pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space")
    plain_bpe = not any(
        model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
    )
    if model.get("type") != "BPE" or not byte_level or not plain_bpe or spec.get("normalizer"):
        what = pre.get("type") or model.get("type") or "unknown"
        raise LmcliError(
            "GGUF export supports byte-level BPE tokenizers with GPT-2's pre-tokenizer, "
            f"not this one ({what})"
        )
    if tok.vocab_size > vocab_size:
        raise LmcliError(f"tokenizer has {tok.vocab_size} tokens, the model only {vocab_size}")
    by_id = {i: t for t, i in tok.hf.get_vocab(with_added_tokens=True).items()}
    added = tok.hf.get_added_tokens_decoder()
    TT = gguf.TokenType
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
        else:
            tokens.append(by_id[i])
            special = i in added and added[i].special
            types.append(TT.CONTROL if special else TT.USER_DEFINED if i in added else TT.NORMAL)
    merges = [_merge_text(m) for m in model.get("merges") or []]
    special_ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    for role in ("unk", "sep"):
        if getattr(tok, f"{role}_id", None) is not None:
            special_ids[role] = getattr(tok, f"{role}_id")
    if not merges:  # the byte tokenizer: one merge no byte-level piece can match (see the module doc)
        controls = [tokens[i] for i in range(vocab_size) if types[i] == TT.CONTROL]
        if len(controls) < 2:
            raise LmcliError("GGUF export of a BPE tokenizer without merges needs two special tokens")
        merges = [f"{controls[0]} {controls[1]}"]
    return GgufVocab(tokens, [int(t) for t in types], merges, special_ids)


# ----------------------------------------------------------------------------- the file


def run_name(run_dir: str | Path) -> str:
    """A run folder's name; ``RUN-best`` for a checkpoint inside one."""
    path = Path(run_dir).resolve()
    if path.name in ("best", "last") or path.name.startswith("step-"):
        return f"{path.parent.name}-{path.name}"
    return path.name


def default_gguf_path(run_dir: str | Path, dtype: str) -> Path:
    """``NAME-DTYPE.gguf`` in the current folder (NAME: ``run_name``)."""
    return Path(f"{run_name(run_dir)}-{dtype}.gguf")


def write_gguf(
    model: torch.nn.Module, tok: Tokenizer, out: str | Path, dtype: str = "f16", name: str = "lmcli"
) -> Path:
    """Write ``model`` and ``tok`` as one GGUF file ``out`` (a new file; written whole or not at all)."""
    gguf = _gguf()
    if dtype not in GGUF_TYPES:
        raise LmcliError(f"invalid GGUF type {dtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    cfg: ModelConfig = model.config
    family = for_export(cfg, "gguf")
    vocab = gguf_vocab(tok, cfg.vocab_size)
    tensors = family.to_gguf({k: v.float() for k, v in logical_state(model).items()}, cfg)
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise LmcliError(f"{out} already exists: choose a new file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }.get(dtype, gguf.LlamaFileType.MOSTLY_Q4_0)

    tmp = temp_file(out)
    try:
        w = gguf.GGUFWriter(str(tmp), family.gguf_arch)
        w.add_name(name)
        w.add_file_type(file_type)
        if dtype in ("q8_0", "q4_0"):
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(cfg.block_size)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.ffn_dim)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_kv_head)
        w.add_vocab_size(cfg.vocab_size)
        family.gguf_metadata(w, cfg)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.types)
        w.add_token_merges(vocab.merges)
        for role, token_id in vocab.special_ids.items():
            getattr(w, f"add_{role}_token_id")(token_id)
        w.add_add_bos_token(True)  # lmcli reads every text as <bos> text
        w.add_add_eos_token(False)
        if getattr(tok, "chat_template", None):  # a tokenizer imported with one keeps it
            w.add_chat_template(tok.chat_template)
        for tensor_name, t in tensors.items():
            vocabulary = dtype == "q4_0" and tensor_name in VOCABULARY_TENSORS
            data, raw_type = encode_tensor(t, "q8_0" if vocabulary else dtype)
            w.add_tensor(tensor_name, data, raw_dtype=raw_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)  # a file to share, not the private temporary it was written as
        os.replace(tmp, out)
    except OSError as exc:  # a full disk: named by OUT and its cause, no partial file left
        reason = write_error(exc, tmp)
        tmp.unlink(missing_ok=True)
        raise LmcliError(f"cannot write {out}: {reason}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def export_gguf(path: str | Path, out: str | Path | None = None, dtype: str = "f16") -> Path:
    """Export the checkpoint (or run folder) ``path`` as a GGUF file; returns the file written."""
    ckpt = load_checkpoint(path)
    out = Path(out) if out is not None else default_gguf_path(path, dtype)
    return write_gguf(ckpt.model, ckpt.tokenizer, out, dtype, name=run_name(path))
