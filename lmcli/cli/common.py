"""What the commands share: a config built from flags, a model source loaded (and its
draft), prompts read from files.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from lmcli.config.commands import (
    QUANTIZE_MODES,
    DeviceConfig,
    DraftConfig,
)
from lmcli.config.files import field_names, from_dict

C = TypeVar("C")


RUN_DIR_HELP = "Run or checkpoint folder, Hugging Face folder or GGUF file. [default: newest in checkpoints/]"


def build(cls: type[C], options: dict[str, Any]) -> C:
    """The config ``cls`` from the given options that are its fields (defaults for the rest)."""
    names = field_names(cls)
    return from_dict(cls, {k: v for k, v in options.items() if k in names}, source="options")


def read_lines(
    path: Path | None, inline: list[str] | None, keep: int | None = None, end: bool = True
) -> list[str] | None:
    """Inputs from --prompt values, a file (one per line, .gz allowed), or piped stdin; None if
    none. ``keep``: a file's longer line is read as its last (``end``) or first ``keep``
    characters only (``data.corpus.read_lines``)."""
    if inline:
        return list(inline)
    if path is not None:
        from lmcli.data.corpus import read_lines

        return read_lines(path, keep, end)
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        return [line.rstrip("\r") for line in data.removesuffix("\n").split("\n")] if data else None
    return None


def load_source(run_dir: Path | None, options: dict[str, Any]) -> Any:
    """The checkpoint to decode or evaluate with, on the device the options ask for, with the
    CPU threads they ask for, its linear layers quantized as asked (``--quantize``) and its KV
    cache's dtype (``--kv-dtype``)."""
    from lmcli.device import pick_device, set_threads
    from lmcli.formats.sources import DTYPES, load_model
    from lmcli.model.kv_cache import check_format, kv_dtype
    from lmcli.model.quant import default_kv_dtype, products_line

    cfg = build(DeviceConfig, options)
    set_threads(cfg.threads)
    if cfg.quantize not in QUANTIZE_MODES:  # a GGUF preset: llama-quantize's blocks, as stored
        return _load_preset(run_dir, cfg)
    # a GGUF file's quantized matrices run as stored unless --quantize asks for lmcli's own; a
    # Hugging Face folder is quantized as it is read (never whole in floats)
    ckpt = load_model(
        run_dir,
        pick_device(cfg.device),
        DTYPES.get(cfg.dtype),
        as_stored=cfg.quantize == "none",
        quantize=cfg.quantize,
        group_size=cfg.group_size,
    )
    # auto: float16 for GGUF blocks on the native kernels, else None (the dtype it computes in)
    ckpt.model.kv_dtype = kv_dtype(cfg.kv_dtype) or default_kv_dtype(ckpt.model)
    check_format(ckpt.model.kv_dtype, ckpt.model.config.head_dim)
    if cfg.verbose:
        print(products_line(ckpt.model), file=sys.stderr)
        if next(ckpt.model.parameters()).device.type == "cpu":  # (the one-call decoding step's)
            from lmcli.model.fastpath.native_step import step_line

            print(step_line(ckpt.model), file=sys.stderr)
    return ckpt


def _load_preset(run_dir: Path | None, cfg: DeviceConfig) -> Any:
    """``--quantize PRESET``: the model loaded in floats on the CPU, then its matrices made the
    preset's blocks (``formats.export.in_memory``)."""
    import torch

    from lmcli.device import pick_device
    from lmcli.formats.export.in_memory import check_preset, quantized_as_preset
    from lmcli.formats.sources import DTYPES, load_model
    from lmcli.model.quant import default_kv_dtype, products_line

    device = pick_device(cfg.device)
    check_preset(cfg.quantize, device)
    # float32 unless told (a quantized file's norms load so): an f16 file's are not half here
    ckpt = load_model(run_dir, device, DTYPES.get(cfg.dtype) or torch.float32)
    ckpt.model = quantized_as_preset(ckpt.model, ckpt.tokenizer, cfg.quantize)
    ckpt.model.kv_dtype = DTYPES.get(cfg.kv_dtype) or default_kv_dtype(ckpt.model)
    if cfg.verbose:
        print(products_line(ckpt.model), file=sys.stderr)
    return ckpt


@contextlib.contextmanager
def loaded_source(run_dir: Path | None, options: dict[str, Any]) -> Iterator[Any]:
    """``load_source``'s checkpoint, used inside its device's precision scope: TF32 matmuls and, on a
    GPU, bf16 autocast for float32 weights, as in training (``lmcli.device.inference_dtype``)."""
    from lmcli.device import inference_dtype, precision

    ckpt = load_source(run_dir, options)
    param = next(ckpt.model.parameters())
    amp = inference_dtype(param.device, build(DeviceConfig, options).dtype, param.dtype)
    with precision(param.device, amp):
        yield ckpt


def load_draft(options: dict[str, Any], ckpt: Any) -> Any:
    """``--draft``'s model (on the model's device and dtype), its tokenizer checked against the
    model's; None without ``--draft``."""
    cfg = build(DraftConfig, options)
    if cfg.draft is None:
        return None
    from lmcli.formats.sources import load_model
    from lmcli.generate.speculative import Draft, check_draft
    from lmcli.model.kv_cache import check_format

    param = next(ckpt.model.parameters())
    draft = load_model(cfg.draft, param.device, param.dtype, as_stored=True)
    check_draft(ckpt.tokenizer, draft.tokenizer, cfg.draft)
    draft.model.kv_dtype = ckpt.model.kv_dtype  # the draft's cache as the model's (--kv-dtype)
    check_format(draft.model.kv_dtype, draft.model.config.head_dim)
    return Draft(draft.model, draft.tokenizer, cfg.draft_tokens)


def warn_prompts(prompts: list[Any]) -> None:
    warn_inputs(sum(p.unknown for p in prompts), sum(p.truncated for p in prompts))


def warn_inputs(unknown: int, cut: int) -> None:
    if unknown:
        print(f"warning: {unknown} character(s) unknown to the tokenizer became <unk>", file=sys.stderr)
    if cut:
        print(f"warning: {cut} input(s) longer than the context were cut to fit", file=sys.stderr)
