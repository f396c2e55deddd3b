"""An importance matrix from a calibration text: lmcli's forward with a hook on every linear layer
of the blocks, summing the squares of each input column, as llama.cpp's ``llama-imatrix`` does.

The text is tokenized and cut into windows of ``context`` tokens (the last partial one dropped),
the first token of each window made ``<bos>`` when the tokenizer puts one first; each window runs
through the model and every block's linear layer adds its inputs' per-column squares and its
number of input rows to the entries of the GGUF tensors it becomes (the family adapter's map:
lmcli's fused query/key/value projection is GGUF's ``attn_q``, ``attn_k`` and ``attn_v``, which
share those inputs). The vocabulary head is left out, as ``llama-imatrix`` leaves it out by
default (its rows are quantized without importance weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lmcli.errors import LmcliError
from lmcli.formats.families import FamilyAdapter
from lmcli.formats.gguf.imatrix import ImportanceMatrix
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer, split_pieces


def gguf_names(family: FamilyAdapter, model: Transformer) -> dict[str, list[str]]:
    """Each linear layer of the blocks (its module path) -> the GGUF tensors it becomes."""
    cfg = model.config
    out = {}
    for path, module in model.h.named_modules(prefix="h"):
        if isinstance(module, torch.nn.Linear):
            weight = {f"{path}.weight": torch.empty(module.weight.shape, device="meta")}
            out[path] = list(family.to_gguf(weight, cfg))
    return out


def calibration_ids(tokenizer: Tokenizer, text: str, context: int) -> list[list[int]]:
    """The text's tokens as windows of ``context``, the first of each ``<bos>`` when the tokenizer
    puts one first (llama-imatrix's chunks); one line when the text fills no window."""
    ids = [i for piece in split_pieces(text) for i in tokenizer.encode(piece)]
    if tokenizer.add_bos:
        ids.insert(0, tokenizer.bos_id)
    n = len(ids) // context
    if n == 0:
        raise LmcliError(f"the calibration text has {len(ids)} tokens: a window needs {context}")
    windows = [ids[i * context : (i + 1) * context] for i in range(n)]
    if tokenizer.add_bos:
        for w in windows:
            w[0] = tokenizer.bos_id
    return windows


@torch.inference_mode()
def collect_imatrix(
    model: Transformer,
    family: FamilyAdapter,
    windows: Iterable[list[int]],
    *,
    batch_size: int = 1,
    dataset: str = "",
) -> ImportanceMatrix:
    """The importance matrix of ``model`` over token ``windows`` (each of one length)."""
    names = gguf_names(family, model)
    sums: dict[str, Tensor] = {}
    rows: dict[str, int] = {}

    def hook(path: str):  # noqa: ANN202 - a forward pre-hook
        def add(module: torch.nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].size(-1)).double()  # (rows, columns)
            squares = x.pow(2).sum(0).cpu()
            sums[path] = sums[path] + squares if path in sums else squares
            rows[path] = rows.get(path, 0) + x.size(0)

        return add

    modules = dict(model.h.named_modules(prefix="h"))
    handles = [modules[path].register_forward_pre_hook(hook(path)) for path in names]
    device = next(model.parameters()).device
    chunks = 0
    context = 0
    try:
        batch: list[list[int]] = []
        for w in [*windows, None]:
            if w is not None:
                batch.append(w)
                context = len(w)
            if batch and (w is None or len(batch) == batch_size):
                model(torch.tensor(batch, dtype=torch.long, device=device))
                chunks += len(batch)
                batch = []
    finally:
        for h in handles:
            h.remove()
    out = ImportanceMatrix(datasets=[dataset] if dataset else [], chunk_count=chunks, chunk_size=context)
    for path, tensors in names.items():
        for name in tensors:
            if path in sums:
                out.add(name, sums[path].numpy().astype(np.float32), rows[path])
    return out


def imatrix_of_text(
    model: Transformer,
    tokenizer: Tokenizer,
    family: FamilyAdapter,
    text_path: str | Path,
    *,
    context: int | None = None,
    batch_size: int = 1,
) -> ImportanceMatrix:
    """The importance matrix of ``model`` over the calibration text file ``text_path``."""
    path = Path(text_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LmcliError(f"{path}: a calibration text must be UTF-8 text") from None
    except OSError as exc:
        raise LmcliError(f"cannot read {path}: {exc.strerror or exc}") from None
    context = context or model.config.block_size
    if context > model.config.block_size:
        raise LmcliError(f"context {context} exceeds the model's block size {model.config.block_size}")
    if not text.strip():
        raise LmcliError(f"{path}: the calibration text is empty")
    windows = calibration_ids(tokenizer, text, context)
    model.eval()
    return collect_imatrix(model, family, windows, batch_size=batch_size, dataset=path.name)


def imatrix_of_source(
    path: str | Path,
    text_path: str | Path,
    device: torch.device | str = "cpu",
    context: int | None = None,
    batch_size: int = 1,
) -> ImportanceMatrix:
    """The importance matrix of the model ``path`` names (loaded in float32) over a text file."""
    from lmcli.formats.families import for_export
    from lmcli.formats.sources import load_model

    text_path = Path(text_path)
    if not text_path.is_file():
        raise LmcliError(f"no such calibration text: {text_path}")
    ckpt = load_model(path, device, torch.float32)
    family = for_export(ckpt.model.config, "gguf")
    return imatrix_of_text(
        ckpt.model, ckpt.tokenizer, family, text_path, context=context, batch_size=batch_size
    )


def is_imatrix_file(path: str | Path) -> bool:
    """Whether ``path`` is an importance matrix file (GGUF's magic, or a ``.dat`` name) rather than
    a calibration text."""
    from lmcli.formats.gguf.check import MAGIC
    from lmcli.safe_io import open_input

    path = Path(path)
    if path.suffix == ".dat":
        return True
    with open_input(path, "importance matrix or calibration text") as f:
        return f.read(4) == MAGIC


def importance_matrix(arg: str | Path, model: str | Path) -> ImportanceMatrix:
    """``export --imatrix``: an importance matrix file read, or one computed from a calibration
    text with the model ``model`` names."""
    from lmcli.formats.gguf.imatrix import read_imatrix

    if not Path(arg).exists():
        raise LmcliError(f"no such importance matrix or calibration text: {arg}")
    return read_imatrix(arg) if is_imatrix_file(arg) else imatrix_of_source(model, arg)
