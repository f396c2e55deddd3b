"""GGUF export: an lmcli checkpoint as one file that llama.cpp, and the tools built on it, run.

The file is written with ``gguf``, the llama.cpp project's own Python package: its metadata keys,
file layout and Q8_0 quantization. The architecture, its own metadata and the tensor names come
from the family adapter (``lmcli.formats.families``); this module writes the file and the tokenizer.

Two GGUF architectures express lmcli models:

- ``gpt2``: learned positions, pre-LayerNorm, the tanh-GELU MLP, biases everywhere (llama.cpp
  requires them); tied or untied head, any number of key/value heads;
- ``llama``: rotary positions, pre-RMSNorm, the SwiGLU MLP; biases optional (llama.cpp reads
  them where present), tied or untied head, any number of key/value heads.

Rotary layout: lmcli turns the two halves of each head against each other (``rotate_half``, as
Hugging Face's Llama does); llama.cpp's ``llama`` turns adjacent pairs. The Llama adapter's map
reorders the query and key rows of each head so that llama.cpp's pair (2i, 2i+1) holds lmcli's
pair (i, i + D/2). Attention scores do not change: queries and keys move together.

Tokenizer (``lmcli.formats.gguf.vocab``): a byte-level BPE is GGUF's ``gpt2`` tokenizer model, with the
source's pre-tokenizer by its GGUF name (GPT-2's ``gpt-2`` for lmcli's own), ``add_bos_token`` as
the tokenizer says and its chat template; a SentencePiece-style one (a BPE with byte fallback,
spaces as ``▁``: Llama 2's, Gemma's) is GGUF's ``llama`` model, with scores and
``add_space_prefix`` (``gguf/spm.py``). The char tokenizer is refused.

Any source exports (``export_gguf``): an lmcli run or checkpoint, a Hugging Face folder, a GGUF
file; ``general.name`` is the source's name (a run folder's, ``RUN-best`` for a checkpoint in
one, a Hugging Face folder's, a GGUF file's own ``general.name``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.families import for_export
from lmcli.formats.gguf.vocab import gguf_vocab, write_vocab
from lmcli.formats.sources import load_model
from lmcli.formats.weights import logical_state
from lmcli.safe_io import temp_file, write_error
from lmcli.text.tokenizer import Tokenizer

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


# ----------------------------------------------------------------------------- the file


def run_name(run_dir: str | Path) -> str:
    """A run folder's (or any folder's) name; ``RUN-best`` for a checkpoint inside one."""
    path = Path(run_dir).resolve()
    if path.name in ("best", "last") or path.name.startswith("step-"):
        return f"{path.parent.name}-{path.name}"
    return path.name


def write_gguf(
    model: torch.nn.Module, tok: Tokenizer, out: str | Path, dtype: str = "f16", name: str = "lmcli"
) -> Path:
    """Write ``model`` and ``tok`` as one GGUF file ``out`` (a new file; written whole or not at all)."""
    gguf = _gguf()
    if dtype not in GGUF_TYPES:
        raise LmcliError(f"invalid GGUF type {dtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    cfg: ModelConfig = model.config
    family = for_export(cfg, "gguf")
    vocab = gguf_vocab(tok, cfg.vocab_size, gguf.TokenType)
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
        w.add_context_length(family.gguf_context(cfg))
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.ffn_dim)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_kv_head)
        w.add_vocab_size(cfg.vocab_size)
        family.gguf_metadata(w, cfg)
        write_vocab(w, vocab, tok.chat_template)
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
    """Export the model ``path`` names (a run or checkpoint folder, a Hugging Face folder, a GGUF
    file) as a GGUF file; returns the file written."""
    ckpt = load_model(path)
    name = ckpt.meta.get("name") or run_name(path)
    out = Path(out) if out is not None else Path(f"{name}-{dtype}.gguf")
    return write_gguf(ckpt.model, ckpt.tokenizer, out, dtype, name=name)
