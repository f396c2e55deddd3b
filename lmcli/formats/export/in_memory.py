"""``--quantize PRESET`` (Q4_K_M, q8_0, ...): a loaded model's matrices quantized as
``export --dtype PRESET`` would write them, then held as stored, as a GGUF file of that preset is
(``gguf.as_stored``): the same per-tensor types, the same bytes, multiplied by lmcli's kernels.

The file is never written: each tensor, under its GGUF name and in llama.cpp's row order, becomes
a ``GgufTensor`` over its blocks in memory (a type the preset leaves float: f16 values, as the
file would hold them), and ``load_as_stored`` builds the model from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lmcli.errors import LmcliError
from lmcli.formats.export.gguf import mapped_tensors, planned_tensors
from lmcli.formats.export.presets import ModelShape, check_quantizes, preset, tensor_types
from lmcli.formats.export.stream import model_source
from lmcli.formats.families import HFConfig, for_export
from lmcli.formats.gguf.as_stored import load_as_stored
from lmcli.formats.gguf.imatrix import ImportanceMatrix
from lmcli.formats.gguf.load import GgufHeader, GgufTensor
from lmcli.model.native import ops
from lmcli.model.native.blocks import quantize_blocks
from lmcli.model.transformer import Transformer
from lmcli.text.tokenizer import Tokenizer


def check_preset(name: str, device: torch.device) -> None:
    """One line unless the preset ``name`` can run here: GGUF blocks on lmcli's CPU kernels."""
    if device.type != "cpu":
        raise LmcliError(f"--quantize {name} runs GGUF blocks on lmcli's CPU kernels: use --device cpu")
    if not ops.available():
        why = ops.backend_line().removeprefix("quantized products: torch ")
        raise LmcliError(f"--quantize {name} needs lmcli's native kernels, which are not available {why}")


def quantized_as_preset(
    model: Transformer, tok: Tokenizer, name: str, imatrix: ImportanceMatrix | None = None
) -> Transformer:
    """``model`` with its matrices in preset ``name``'s blocks (llama-quantize's types), held as
    stored; one line for a type lmcli's kernels do not run."""
    p = preset(name)
    cfg = model.config
    family = for_export(cfg, "gguf")
    shapes = planned_tensors(family, cfg)
    shape = ModelShape(family.gguf_arch or "", cfg.n_layer, cfg.n_head, cfg.n_kv_head)
    types = tensor_types(p, shapes, shape, imatrix=imatrix is not None)
    check_quantizes(p, types, shapes)
    missing = sorted({t for t in types.values() if t and t not in ("f16", "f32") and t not in ops.FORMATS})
    if missing:
        raise LmcliError(
            f"--quantize {name}: lmcli's kernels do not multiply {', '.join(missing)} blocks yet "
            f"(they run {', '.join(ops.FORMATS)}); export --dtype {name} writes such a file"
        )
    tensors = {}
    dtype = next(model.parameters()).dtype
    for gguf_name, t in mapped_tensors(model_source(model, tok, "lmcli"), family, shapes):
        kind = types[gguf_name]
        if kind in ops.FORMATS:
            weights = imatrix.weights(gguf_name) if imatrix is not None else None
            qw = torch.from_numpy(weights) if weights is not None else None
            data = quantize_blocks(t, kind, qw).numpy()
            tensors[gguf_name] = GgufTensor(gguf_name, kind.upper(), tuple(t.shape), data)
        elif kind == "f16":
            data = t.detach().float().numpy().astype(np.float16)
            tensors[gguf_name] = GgufTensor(gguf_name, "F16", tuple(t.shape), data)
        else:
            data = t.detach().float().numpy().copy()
            tensors[gguf_name] = GgufTensor(gguf_name, "F32", tuple(t.shape), data)
    where = Path(f"--quantize {name}")
    header = GgufHeader(where, HFConfig({}, "--quantize"), tensors, family, cfg, tok, {}, [])
    return load_as_stored(header, dtype)
