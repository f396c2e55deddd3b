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
file, a LoRA run merged; ``general.name`` is the source's name (a run folder's, ``RUN-best`` for a
checkpoint in one, a Hugging Face folder's, a GGUF file's own ``general.name``).

Types: a llama-quantize preset (``presets.py``: f32, f16, q8_0, q4_0 ... Q4_K_M, IQ4_XS, any
case), each tensor's type chosen by llama.cpp's rules and its blocks written by lmcli's own
quantizer (``native.blocks.quantize_blocks``, byte for byte ggml's), with importance weights
from an importance matrix (``gguf.imatrix``) where given. Norms and biases stay f32.

Streaming (``write_source``): the tensor table is laid out first from the config alone (names and
shapes through the adapter's map on the meta device), then the weights are read a group at a
time (``stream.ExportSource``: the tensors of no block, then each block), each tensor mapped,
quantized and written before the next group is read: the peak is about one group's float
tensors plus one tensor's blocks, whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmcli.config.model import ModelConfig
from lmcli.errors import LmcliError
from lmcli.formats.export.presets import ModelShape, Preset, check_quantizes, preset, tensor_types
from lmcli.formats.export.stream import ExportSource, in_groups, model_source, open_source, stored_values
from lmcli.formats.families import FamilyAdapter, for_export
from lmcli.formats.gguf.imatrix import ImportanceMatrix, check_against
from lmcli.formats.gguf.load import GgufTensor
from lmcli.formats.gguf.vocab import gguf_vocab, write_vocab
from lmcli.formats.weights import DISK_NAMES
from lmcli.model.native.blocks import block_shape, check_writable, quantize_blocks
from lmcli.model.skeleton import skeleton
from lmcli.safe_io import published
from lmcli.text.tokenizer import Tokenizer


def _gguf() -> Any:
    """The ``gguf`` package, or a one-line error saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise LmcliError("GGUF export needs the gguf package: pip install gguf") from None
    return gguf


# ----------------------------------------------------------------------------- the plan


def planned_tensors(family: FamilyAdapter, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the file holds, GGUF name -> shape (PyTorch's order), in the order written:
    the adapter's map of the model's skeleton (matrices on the meta device; vectors as zeros,
    which a map may shift), group by group as ``ExportSource.groups`` hands them out."""
    state = {DISK_NAMES.get(k, k): v for k, v in skeleton(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    plan: dict[str, tuple[int, ...]] = {}
    for names in in_groups(list(state)):
        group = {}
        for name in names:
            shape = list(state[name].shape)
            if name in ("wte.weight", "lm_head.weight"):
                shape[0] = cfg.vocab_size  # the logical vocabulary
            group[name] = torch.zeros(shape) if len(shape) == 1 else torch.empty(shape, device="meta")
        plan.update({k: tuple(v.shape) for k, v in family.to_gguf(group, cfg).items()})
    return plan


def written_as(kind: str | None, ndim: int, p: Preset) -> str:
    """The type a tensor is written in: ``kind``, or for one llama-quantize leaves alone (None) what
    lmcli writes: vectors f32, matrices f16 (f32 in an F32 file)."""
    return kind or ("f32" if ndim == 1 or p.default == "f32" else "f16")


def encode_tensor(
    t: torch.Tensor, kind: str | None, p: Preset, weights: np.ndarray | None, threads: int | None
) -> tuple[np.ndarray, Any]:
    """(data, raw GGML type or None) of one tensor of type ``kind`` (``written_as``)."""
    kind = written_as(kind, t.dim(), p)
    t = t.detach().cpu()
    if kind == "f32":
        return t.float().numpy(), None
    if kind == "f16":  # (rounded to nearest even, as ggml's conversion; an f16 source as it is)
        return (t if t.dtype == torch.float16 else t.float().half()).numpy(), None
    qw = torch.from_numpy(weights) if weights is not None else None
    blocks = quantize_blocks(t, kind, qw, threads)
    return blocks.numpy(), _gguf().GGMLQuantizationType[kind.upper()]


def _info(shape: tuple[int, ...], kind: str | None, p: Preset) -> tuple[tuple[int, ...], Any, int, Any]:
    """(shape as the writer takes it, numpy dtype, bytes, raw GGML type) of a planned tensor."""
    kind = written_as(kind, len(shape), p)
    if kind in ("f32", "f16"):
        dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
        return shape, dtype, int(np.prod(shape)) * dtype.itemsize, None
    block, block_bytes = block_shape(kind)
    row = shape[-1] // block * block_bytes
    raw = _gguf().GGMLQuantizationType[kind.upper()]
    return (*shape[:-1], row), np.dtype(np.uint8), int(np.prod(shape[:-1])) * row, raw


# ----------------------------------------------------------------------------- the file


def write_gguf(
    model: torch.nn.Module,
    tok: Tokenizer,
    out: str | Path,
    dtype: str = "f16",
    name: str = "lmcli",
    imatrix: ImportanceMatrix | None = None,
) -> Path:
    """Write ``model`` and ``tok`` as one GGUF file ``out`` (a new file; written whole or not at all)."""
    return write_source(model_source(model, tok, name), out, dtype, imatrix)


def write_source(
    source: ExportSource,
    out: str | Path,
    dtype: str = "f16",
    imatrix: ImportanceMatrix | None = None,
    threads: int | None = None,
) -> Path:
    """Write ``source`` as one GGUF file ``out`` of preset ``dtype``, streaming its weights (see
    the module doc); every check before the file is opened, nothing left behind on failure."""
    gguf = _gguf()
    p = preset(dtype)
    cfg = source.config
    family = for_export(cfg, "gguf")
    vocab = gguf_vocab(source.tokenizer, cfg.vocab_size, gguf.TokenType)
    shapes = planned_tensors(family, cfg)
    shape = ModelShape(family.gguf_arch or "", cfg.n_layer, cfg.n_head, cfg.n_kv_head)
    types = tensor_types(p, shapes, shape, imatrix=imatrix is not None)
    check_quantizes(p, types, shapes)
    check_writable([t for t in types.values() if t and t not in ("f16", "f32")], imatrix is not None)
    if imatrix is not None:
        check_against(imatrix, {n: s[-1] for n, s in shapes.items() if types[n] is not None}, "--imatrix")
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise LmcliError(f"{out} already exists: choose a new file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    with published(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), family.gguf_arch)
        _metadata(w, family, cfg, source.name, p, imatrix)
        write_vocab(w, vocab, source.tokenizer.chat_template)
        for name, s in shapes.items():
            w.add_tensor_info(name, *_info(s, types[name], p))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, t in source_tensors(source, family, shapes):
            if isinstance(t, GgufTensor) and t.quantized and t.kind.lower() == (types[name] or "").lower():
                # the type it has: its blocks as they are, as llama.cpp copies them
                w.write_tensor_data(t.data)
                continue
            t = stored_values(t) if isinstance(t, GgufTensor) else t
            weights = imatrix.weights(name) if imatrix is not None and types[name] else None
            w.write_tensor_data(encode_tensor(t, types[name], p, weights, threads)[0])
            del t  # (before the next group is read)
        w.close()
    return out


def source_tensors(
    source: ExportSource, family: FamilyAdapter, shapes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor | GgufTensor]]:
    """The tensors to write, in the planned order: a GGUF file read through the family that writes
    it hands its tensors over as stored, by name (no map there and back); any other source's are
    mapped a group at a time (``mapped_tensors``)."""
    header = source.header
    if header is not None and header.family is family and set(header.tensors) == set(shapes):
        for name, shape in shapes.items():
            if header.tensors[name].shape != shape:  # the map would not move it: a bug
                raise RuntimeError(f"export: {name} {header.tensors[name].shape} where the plan has {shape}")
            yield name, header.tensors[name]
        return
    yield from mapped_tensors(source, family, shapes)


def mapped_tensors(
    source: ExportSource, family: FamilyAdapter, shapes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors under GGUF's names, in the planned order, a group at a time."""
    order = iter(shapes.items())
    for group in source.groups():
        mapped = family.to_gguf(group, source.config)
        group.clear()  # this group's floats go once each is written, before the next is read
        for name in list(mapped):
            t = mapped.pop(name)
            expected = next(order, None)
            if expected != (name, tuple(t.shape)):  # the plan and the weights disagree: a bug
                raise RuntimeError(f"export: {name} {tuple(t.shape)} where the plan has {expected}")
            yield name, t
            del t
    if next(order, None) is not None:
        raise RuntimeError("export: the source ended before the plan")


def _metadata(
    w: Any, family: FamilyAdapter, cfg: ModelConfig, name: str, p: Preset, imatrix: ImportanceMatrix | None
) -> None:
    """The file's metadata: its name and type, the hyperparameters, the importance matrix's origin."""
    gguf = _gguf()
    w.add_name(name)
    w.add_file_type(p.file_type)
    if p.quantized:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(family.gguf_context(cfg))
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_vocab_size(cfg.vocab_size)
    family.gguf_metadata(w, cfg)
    if imatrix is not None:  # the keys llama-quantize writes
        if imatrix.source:
            w.add_string("quantize.imatrix.file", imatrix.source)
        if imatrix.datasets:
            w.add_string("quantize.imatrix.dataset", imatrix.datasets[0])
        w.add_uint32("quantize.imatrix.entries_count", len(imatrix.sums))
        if imatrix.chunk_count > 0:
            w.add_uint32("quantize.imatrix.chunks_count", imatrix.chunk_count)


def export_gguf(
    path: str | Path,
    out: str | Path | None = None,
    dtype: str = "f16",
    imatrix: ImportanceMatrix | None = None,
    threads: int | None = None,
) -> Path:
    """Export the model ``path`` names (a run or checkpoint folder, a LoRA run, a Hugging Face
    folder, a GGUF file) as a GGUF file of preset ``dtype``; returns the file written."""
    source = open_source(path)
    out = Path(out) if out is not None else Path(f"{source.name}-{dtype}.gguf")
    return write_source(source, out, dtype, imatrix, threads)
