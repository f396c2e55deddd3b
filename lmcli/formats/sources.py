"""Model sources opened: what a command is given as its model, loaded by its kind
(``lmcli.formats.model_source`` says which kind, once):

- an lmcli run folder (its ``best``, else ``last``) or checkpoint folder (``lmcli.formats.checkpoint``
  reads its files);
- a LoRA run: its base (an lmcli checkpoint, a Hugging Face folder or a GGUF file, found
  unchanged by ``lmcli.formats.lora_base``) with the adapters put on, or merged into the weights;
- a local Hugging Face folder (``lmcli.formats.hf.load``); with ``quantize`` on a CPU, quantized
  as it is read (``load_hf_quantized``: one block's float weights at a time, never the whole
  float model);
- a GGUF file (``lmcli.formats.gguf.load``: llama.cpp's format, its tensors dequantized);
- nothing: the newest run under ``checkpoints/``.

``read_model_config`` answers what model a source holds (its ``ModelConfig``) from its configs
or header alone, without reading its weights (``ModelSource.config``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from lmcli.config.files import replace_options
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.device import release_freed_memory
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    ADAPTERS,
    BASE,
    WEIGHTS,
    Checkpoint,
    read_configs,
    read_consistently,
    read_json,
    read_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
)
from lmcli.formats.gguf.as_stored import load_gguf_as_stored
from lmcli.formats.gguf.load import load_gguf
from lmcli.formats.hf.load import load_hf_folder, open_hf_folder, read_blocks
from lmcli.formats.hf.weights import LAYER, read_headers
from lmcli.formats.lora_base import checked_base, load_adapted
from lmcli.formats.model_source import ModelSource, model_source
from lmcli.formats.weights import DTYPES as STORED_DTYPES
from lmcli.formats.weights import MODULE_NAMES, load_weights
from lmcli.model import quant
from lmcli.model.native import ops
from lmcli.model.skeleton import skeleton
from lmcli.model.transformer import Transformer
from lmcli.safe_io import new_folder, write_error
from lmcli.text.tokenizer import Tokenizer

# --dtype names of the commands that read a model
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@read_consistently
def load_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    *,
    with_state: bool = False,
    verify: bool = True,
    merge: bool = True,
) -> Checkpoint:
    """Load a checkpoint (or a run folder's best/last) with nothing but its folder; a LoRA run's
    base with its adapters merged into the weights, or (``merge=False``, to train on) put on."""
    ckpt = resolve_checkpoint(path)
    meta, model_config, train_config, tokenizer = read_configs(ckpt, verify=verify)
    base = None
    if os.path.lexists(ckpt / ADAPTERS):
        base = read_json(ckpt / BASE, "LoRA base reference")
        source = checked_base(ckpt, base)
        model = load_adapted(ckpt, source.path, base_model(source), model_config, train_config, merge=merge)
    else:
        model = load_weights(model_config, ckpt / WEIGHTS)
    model.to(device).eval()
    state = read_trainer_state(ckpt) if with_state else None
    return Checkpoint(ckpt, model, model_config, train_config, tokenizer, meta, state, base)


def base_model(source: ModelSource) -> Transformer:
    """A LoRA run's base model: a Hugging Face folder or a GGUF file in float32 (as it was
    trained), or an lmcli checkpoint."""
    if source.kind == "hf":
        return load_hf_folder(source.path, torch.float32, lambda msg: None)[0]
    if source.kind == "gguf":
        return load_gguf(source.path, torch.float32)[0]
    return load_checkpoint(source.path).model


def load_model(
    path: str | Path | ModelSource | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    as_stored: bool = False,
    quantize: str = "none",
    group_size: int = 64,
) -> Checkpoint:
    """What a command is given (``model_source``): an lmcli run or checkpoint folder, a local
    Hugging Face folder, a GGUF file, or (None) the newest run under ``checkpoints/``; in eval
    mode on ``device``, weights in ``dtype`` (None: as stored). ``as_stored``: a GGUF file's
    q8_0/q4_0/K-quant matrices stay in their blocks on a CPU, multiplied by the native kernels
    (inference only). ``quantize`` (int8, int4: ``lmcli.model.quant``): the linear layers
    quantized, a Hugging Face folder's on a CPU as they are read (``load_hf_quantized``), a GGUF
    file's from its dequantized values (``as_stored`` does not apply)."""
    source = model_source(path)
    on_cpu = torch.device(device).type == "cpu"
    path = source.path
    if source.kind == "hf":
        if quantize != "none" and on_cpu:
            model, tok = load_hf_quantized(path, dtype, quantize, group_size)
        else:
            model, tok = load_hf_folder(path, dtype)
            model.to(device).eval()
            quant.quantize(model, quantize, group_size)
        meta = {"source": "huggingface", "name": path.resolve().name}
        return Checkpoint(path, model, model.config, TrainConfig(), tok, meta)
    if source.kind == "gguf":
        blocks = as_stored and quantize == "none" and on_cpu
        model, tok, meta = (load_gguf_as_stored if blocks else load_gguf)(path, dtype)
        model.to(device).eval()
        quant.quantize(model, quantize, group_size)
        return Checkpoint(path, model, model.config, TrainConfig(), tok, meta)
    ckpt = load_checkpoint(path, device)
    if dtype is not None:
        ckpt.model.to(dtype)
    quant.quantize(ckpt.model, quantize, group_size)
    return ckpt


def load_hf_quantized(
    path: Path, dtype: torch.dtype | None, mode: str, group_size: int
) -> tuple[Transformer, Tokenizer]:
    """A Hugging Face folder on the CPU with its linear layers quantized (``mode``) as they are
    read: one block's float weights (``read_blocks``) become quantized layers before the next
    block is read, so the float model is never whole in memory (a bfloat16 folder of the
    Qwen2.5-0.5B shape: peak 2.2x its int8 weights when loaded whole first, see
    docs/native-kernels.md). The layers are those ``quant.quantize`` makes of the loaded model."""
    quant.check_mode(mode, group_size, torch.device("cpu"))
    folder = open_hf_folder(path)
    cfg = folder.config
    dtype = dtype or stored_dtype(path)
    model = skeleton(cfg)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")  # the embedding's, tied below
    native = ops.available()
    filled: set[str] = set()
    with torch.no_grad():
        for state in read_blocks(folder, dtype):
            state = {MODULE_NAMES.get(k, k): v for k, v in state.items()}
            if cfg.tie_embeddings:
                state.pop("lm_head.weight", None)  # some tied checkpoints store the head too
            for name, value in state.items():  # (the headers were checked: a bug, not bad input)
                if expected.get(name) != value.shape:
                    raise RuntimeError(f"{name} of shape {tuple(value.shape)} does not fit the model")
            model.load_state_dict(state, strict=False, assign=True)
            filled |= state.keys()
            if "wte.weight" in state:  # the rest, read first: the vocabulary's tables
                if cfg.tie_embeddings:
                    model.lm_head.weight = model.wte.weight
                quant.quantize_vocabulary(model, native)
            for i in sorted({int(m.group(1)) for k in state if (m := LAYER.search(k))}):
                quant.quantize_block(model.h[i], mode, group_size, native)
            state.clear()  # these float weights go now, before the next block is read
            release_freed_memory()  # and their pages, not left in the heap
    missing = ", ".join(sorted(expected.keys() - filled)[:3])
    if missing:
        raise LmcliError(f"weights in {path} do not fit the model config (missing: {missing})")
    with torch.device("cpu"):
        model.positions.make_tables(cfg)
    for note in folder.notices:
        print(f"warning: {path}: {note}", file=sys.stderr)
    release_freed_memory()
    return model.eval(), folder.tokenizer


def stored_dtype(path: Path) -> torch.dtype:
    """The floating-point dtype of a Hugging Face folder's token embedding as stored (float32
    when the header names none): what ``load_hf_folder`` loads it in by default."""
    tensors = read_headers(path).tensors
    kinds = [kind for name, (kind, _) in tensors.items() if "embed" in name or "wte" in name]
    return STORED_DTYPES.get(kinds[0], torch.float32) if kinds else torch.float32


def read_model_config(path: str | Path | ModelSource) -> ModelConfig:
    """The ModelConfig of the model ``path`` names (as ``load_model`` would load it), from its
    configs or header alone: nothing is built and no weight is read."""
    return model_source(path).config()


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write the model ``path`` names (a LoRA run's adapters merged) as a plain lmcli checkpoint
    folder ``out``, which must be new or empty."""
    out = new_folder(out)
    ckpt = load_model(path)
    train_config = replace_options(ckpt.train_config, lora_rank=0)  # plain weights now
    meta = {"step": ckpt.meta.get("step"), "exported_from": str(ckpt.path), "time": time.time()}
    if out.exists():
        out.rmdir()
    try:
        save_checkpoint(out, ckpt.model, train_config, ckpt.tokenizer, meta=meta)
    except OSError as exc:  # a full disk: named by OUT, not by the temporary folder
        raise LmcliError(f"cannot write {out}: {write_error(exc)}") from None
    return out
