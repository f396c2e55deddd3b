"""LoRA runs: the base model a run adapts, recorded and checked, and its adapters put back on.

A LoRA run's checkpoint (``lmcli.formats.checkpoint``) holds ``adapters.safetensors`` and ``base.json``:
the folder of the ``--init-from`` base (an lmcli checkpoint or a Hugging Face folder; or a GGUF
file; a relative path is read from the run folder) and the sha256 of its weight files
(``ModelSource.digests``). Loading such a checkpoint (``lmcli.formats.sources``) finds the base
unchanged (``checked_base``: its ``ModelSource``), loads it and calls ``load_adapted``, which checks
the adapters' header against the run's LoRA settings and the base before any adapter is
allocated. The layers are ``lmcli.model.lora``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import ADAPTERS, BASE, OLD, STEP
from lmcli.formats.model_source import ModelSource, model_source
from lmcli.formats.weights import read_header, read_tensors, with_context
from lmcli.model import lora
from lmcli.model.transformer import Transformer
from lmcli.safe_io import checked_file


def base_reference(base: str | Path | ModelSource) -> dict[str, Any]:
    """What a LoRA run records of its ``--init-from`` base: the folder it reads (a run folder's
    checkpoint, a Hugging Face folder, a GGUF file) and the sha256 of its weight files."""
    source = model_source(base)
    folder = source.folder.resolve()
    if source.kind == "lora":
        raise LmcliError(
            f"{folder} is itself a LoRA run: fold its adapters first "
            f"(lmcli export --merge {folder} --format lmcli OUT), then adapt OUT"
        )
    return {"path": str(folder), "sha256": source.digests()}


def checked_base(ckpt: Path, base: dict[str, Any]) -> ModelSource:
    """The base model a LoRA checkpoint's ``base.json`` names, once its weight files are found to
    have the recorded sha256; one line if it is gone or changed."""
    where = ckpt / BASE
    if not isinstance(base.get("path"), str) or not isinstance(base.get("sha256"), dict):
        raise LmcliError(f"{where} has no base path and sha256")
    path = Path(base["path"])
    if not path.is_absolute():  # a run folder moved with its base beside it: read from the run folder
        path = run_folder_of(ckpt) / path
    try:
        source = model_source(path)
    except LmcliError:
        raise LmcliError(f"the base model {path} of LoRA run {ckpt} is gone (see {where})") from None
    if source.digests() != base["sha256"]:
        raise LmcliError(
            f"the base model {path} changed since LoRA run {ckpt} was trained (sha256 of its weights "
            f"differs): restore that base, or train the adapters again"
        )
    return source


def run_folder_of(ckpt: Path) -> Path:
    """The run folder a checkpoint folder belongs to (``RUN/last`` -> ``RUN``), or the checkpoint
    folder itself when it stands alone."""
    name = ckpt.name.removesuffix(OLD)
    return ckpt.parent if name in ("last", "best", "ema") or STEP.fullmatch(name) else ckpt


def load_adapted(
    ckpt: Path,
    base_path: Path,
    model: Transformer,
    model_config: ModelConfig,
    train_config: TrainConfig,
    *,
    merge: bool,
) -> Transformer:
    """A LoRA checkpoint's model: ``model``, its base loaded from ``base_path`` (``checked_base``),
    with the adapters put on (``merge``: folded into the weights). A run trained with a shorter
    ``--block-size`` than its base's context has its base's context cut the same way."""
    if model_config.block_size < model.config.block_size:
        model = with_context(model, model_config.block_size)
    if model.config != model_config:
        raise LmcliError(f"the base model {base_path} does not fit LoRA run {ckpt}'s model config")
    header = read_header(checked_file(ckpt / ADAPTERS))
    lora.check_adapters(model, train_config, header.tensors, str(ckpt / ADAPTERS))  # before allocating
    lora.add_adapters(model, train_config)
    try:
        state = read_tensors(checked_file(ckpt / ADAPTERS))  # read, not mapped (a truncation: no SIGBUS)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0][:200]
        raise LmcliError(f"cannot read adapters {ckpt / ADAPTERS}: {reason}") from None
    lora.load_adapters(model, state, str(ckpt / ADAPTERS))
    return lora.merge(model) if merge else model


def is_lora_run(path: str | Path) -> bool:
    """Whether ``path`` is a LoRA run (or its checkpoint): adapters rather than weights."""
    try:
        return model_source(path).kind == "lora"
    except LmcliError:
        return False
