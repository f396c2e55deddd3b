"""A GGUF file's matrices kept as stored (``load_gguf_as_stored``, what a CPU decode loads): its
tensors in a format the native kernels run (``ops.FORMATS``: q8_0, q4_0, q4_1, q5_0, q5_1, q2_K,
q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, mxfp4) become ``BlockLinear`` layers over the bytes
read from the file (``load.read_data``; no dequantize, no requantize), so the model takes the
file's size in memory; norms, biases, float matrices and the rarer types (``load.DEQUANTIZED``)
load as their values.

The family adapter maps GGUF's tensors to lmcli's names by moving whole rows (the fused q/k/v
projection, llama's rotary row order). Here it maps row numbers instead of values: each stored
matrix stands in as ``arange`` of global row ids, and what comes out names, for each of lmcli's
weights, the file rows it is made of. A run of rows in file order is a view of the bytes read; a
reordered run (llama's q and k) is one copy of those rows; rows of different formats (q/k in
q4_K, v in q6_K) become the parts of a ``StackedBlockLinear``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lmcli.device import release_freed_memory
from lmcli.errors import check_names
from lmcli.formats.gguf.load import (
    GgufHeader,
    GgufTensor,
    default_dtype,
    gguf_meta,
    load_gguf,
    read_gguf_header,
    tell,
)
from lmcli.formats.weights import MODULE_NAMES
from lmcli.model.native import ops
from lmcli.model.quant import BlockEmbedding, BlockLinear, StackedBlockLinear
from lmcli.model.skeleton import skeleton
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer

KINDS = {k.upper(): k for k in ops.FORMATS}  # GGML's type names -> the kernels' formats
POSITIONS = "position_embd.weight"  # GPT-2's learned position table


def keeps_blocks(t: GgufTensor) -> bool:
    """A matrix the kernels multiply as stored (a native format, whole blocks a row)."""
    return t.kind in KINDS and len(t.shape) == 2 and t.shape[1] % ops.FORMATS[KINDS[t.kind]].block == 0


def _parts(ids: Tensor, sources: list[GgufTensor], starts: Tensor, dtype: torch.dtype) -> list[BlockLinear]:
    """The BlockLinear parts holding file rows ``ids`` (global row ids), in order: a run of one
    format is a view of the bytes read where it is one tensor's rows in file order, else one
    copy, its pieces written into it (no copy of a copy: a reordered q and k stacked with v)."""
    which = torch.searchsorted(starts, ids, right=True) - 1  # (n,) index of each row's tensor
    runs: list[tuple[str, list[Tensor | tuple[Tensor, Tensor]]]] = []  # (format, pieces)
    edges = [0, *((which[1:] != which[:-1]).nonzero().flatten() + 1).tolist(), len(ids)]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        src = sources[int(which[lo])]
        local = ids[lo:hi] - starts[which[lo]]
        rows = src.rows()  # (rows, row bytes), a view of the bytes read
        first = int(local[0])
        ordered = torch.equal(local, torch.arange(first, first + len(local)))
        piece = rows[first : first + len(local)] if ordered else (rows, local)  # a view, or rows to gather
        fmt = KINDS[src.kind]
        if runs and runs[-1][0] == fmt:  # same format as the run before: one part
            runs[-1][1].append(piece)
        else:
            runs.append((fmt, [piece]))
    k = {sources[int(i)].shape[1] for i in which.unique()}
    if len(k) != 1:  # the adapter only stacks rows of one width: a bug, not bad input
        raise RuntimeError(f"rows of widths {sorted(k)} stacked into one matrix")
    width = k.pop()
    return [BlockLinear(_joined(pieces), fmt, width, dtype=dtype) for fmt, pieces in runs]


def _joined(pieces: list[Tensor | tuple[Tensor, Tensor]]) -> Tensor:
    """One run's rows: its one view as it is, else every piece (a view, or (rows, ids) to
    gather) written into one new tensor."""
    if len(pieces) == 1 and isinstance(pieces[0], Tensor):
        return pieces[0]
    sizes = [len(p) if isinstance(p, Tensor) else len(p[1]) for p in pieces]
    first = pieces[0] if isinstance(pieces[0], Tensor) else pieces[0][0]
    out = torch.empty(sum(sizes), first.size(1), dtype=first.dtype)
    at = 0
    for piece, n in zip(pieces, sizes, strict=True):
        if isinstance(piece, Tensor):
            out[at : at + n] = piece
        else:
            torch.index_select(piece[0], 0, piece[1], out=out[at : at + n])
        at += n
    return out


def _layer(parts: list[BlockLinear], bias: Tensor | None) -> nn.Module:
    if len(parts) == 1:
        p = parts[0]
        return BlockLinear(p.blocks, p.fmt, p.in_features, bias, p.dtype)
    return StackedBlockLinear(parts, bias)


def load_as_stored(header: GgufHeader, dtype: torch.dtype) -> Transformer:
    """The model of ``header``'s file with every ``keeps_blocks`` matrix as stored and the rest
    converted to ``dtype``; eval mode, on the CPU."""
    # a learned position table is looked up, not multiplied: dequantized like the vectors
    sources = [t for t in header.tensors.values() if keeps_blocks(t) and t.name != POSITIONS]
    starts = torch.tensor([0, *torch.tensor([t.shape[0] for t in sources]).cumsum(0).tolist()])
    state, first = {}, dict(zip((t.name for t in sources), starts.tolist(), strict=False))
    for name, t in header.tensors.items():  # (vectors as stored until mapped: see load_gguf)
        if name in first:
            state[name] = torch.arange(first[name], first[name] + t.shape[0])
        else:
            state[name] = t.dequantized(dtype if len(t.shape) > 1 else None)
    state = header.family.from_gguf(state, header.config)  # names as on disk: wpe.weight, ...
    state = {MODULE_NAMES.get(n, n): v if v.dtype == torch.int64 else v.to(dtype) for n, v in state.items()}
    cfg = header.config
    blocks = {name: state.pop(name) for name in [n for n, v in state.items() if v.dtype == torch.int64]}
    model = skeleton(cfg)
    for name, ids in blocks.items():
        module = name.removesuffix(".weight")
        parts = _parts(ids, sources, starts, dtype)
        if module == "wte":
            table = _layer(parts, None)
            model.wte = BlockEmbedding(table, dtype)
            if cfg.tie_embeddings:
                model.lm_head = table
        else:
            parent, attr = model.get_submodule(module.rpartition(".")[0]), module.rpartition(".")[2]
            setattr(parent, attr, _layer(parts, state.pop(f"{module}.bias", None)))
    expected = {n for n, t in model.state_dict().items() if t.is_meta}
    if cfg.tie_embeddings and "wte.weight" in state:
        expected.discard("lm_head.weight")  # tied below, as model_from_state does
    check_names(expected, state, f"weights {header.path} do not fit the model config")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings and "wte.weight" in state:
        model.lm_head.weight = model.wte.weight
    with torch.device("cpu"):
        model.positions.make_tables(cfg)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a tensor the file does not hold and nothing computed: a bug, not bad input
        raise RuntimeError(f"not materialized after loading: {', '.join(left[:3])}")
    return model.eval()


def load_gguf_as_stored(
    path: str | Path, dtype: torch.dtype | None = None
) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """``load_gguf`` with the block matrices as stored where the native kernels run (else, or
    when the file has none, ``load_gguf`` itself); ``meta["products"]`` says which path."""
    header = read_gguf_header(path)
    if not ops.available() or not any(keeps_blocks(t) for t in header.tensors.values()):
        model, tok, meta = load_gguf(path, dtype)
        return model, tok, {**meta, "products": ops.backend_line()}
    tell(header)
    model = load_as_stored(header, dtype or default_dtype(header))
    tok, meta = header.tokenizer, {**gguf_meta(header), "products": ops.backend_line()}
    del header  # the bytes read of the rows copied (a fused q/k/v), the checks' tables
    release_freed_memory()  # and their pages, not left in the heap
    return model, tok, meta
