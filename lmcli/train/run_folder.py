"""A run's folder and its configs: choosing it, checking it, and resolving what a run trains with.

Options resolve as: dataclass defaults < the resumed run's config < a ``--config`` file < flags.
The run folder holds ``config.json`` (the resolved configs), ``last/``, ``best/`` and optional
``step-N/`` checkpoints (``lmcli.checkpoint``), ``metrics.jsonl`` and ``loss.png``.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from dataclasses import fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from lmcli.checkpoint import last_checkpoint, read_json
from lmcli.config import (
    TOKENIZER_KINDS,
    ModelConfig,
    TrainConfig,
    from_dict,
    split_options,
    stored_fields,
    to_dict,
)
from lmcli.errors import LmcliError


def default_run_dir() -> Path:
    return Path("checkpoints") / datetime.now().strftime("run-%Y%m%d-%H%M%S")


def check_writable(path: Path) -> None:
    """Fail early, before any work, if the run folder cannot be created and written."""
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LmcliError(f"cannot create output folder {path}: {parent} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".lmcli-write-test-"):
            pass
    except OSError as exc:
        raise LmcliError(f"cannot write to output folder {path}: {exc.strerror}") from None


def new_run_dir(cfg: TrainConfig) -> Path:
    """The folder a new run writes to: ``--out`` or a timestamped default, empty and writable."""
    run_dir = Path(cfg.out) if cfg.out else default_run_dir()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise LmcliError(
            f"{run_dir} already holds files: resume with --resume {run_dir} or pick another --out"
        )
    check_writable(run_dir)
    return run_dir


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Local paths (the fields declared ``path=True``) made absolute, so the stored config works
    from any folder (resume, eval). Names that are not local paths (a hub dataset) stay."""

    def fix(p: str) -> str:
        if os.path.isabs(p) or not (Path(p).exists() or glob.has_magic(p)):
            return p
        return str(Path.cwd() / p)

    changes: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if not f.metadata.get("path") or value is None:
            continue
        if f.name == "tokenizer" and value in TOKENIZER_KINDS:
            continue
        changes[f.name] = tuple(fix(v) for v in value) if isinstance(value, tuple) else fix(value)
    return replace(cfg, **changes)


def check_resumable(saved: ModelConfig, requested: ModelConfig) -> None:
    """Resuming may change run length and the like, never what the weights compute."""
    changed = [f for f in ModelConfig.on_resume("fixed") if getattr(saved, f) != getattr(requested, f)]
    if changed:
        what = ", ".join(
            f"{f.replace('_', '-')} {getattr(saved, f)} -> {getattr(requested, f)}" for f in changed
        )
        raise LmcliError(f"cannot resume with a different model shape ({what})")


def resolve_configs(
    file_options: dict[str, Any], cli_options: dict[str, Any], *, resume: str | Path | None = None
) -> tuple[ModelConfig, TrainConfig]:
    """Configs from dataclass defaults < the resumed run's config < a config file < CLI flags."""
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    if resume is not None:
        saved = read_json(last_checkpoint(resume) / "config.json", "run config")
        model, train = dict(saved.get("model", {})), stored_fields(TrainConfig, dict(saved.get("train", {})))
    for source, options in (("config file", file_options), ("options", cli_options)):
        m, t = split_options(options, source=source)
        model.update(m)
        train.update(t)
    if train.get("task") == "translation" and "tokenizer" not in train:
        train["tokenizer"] = "bpe"  # a joint subword vocabulary over both languages
    return from_dict(ModelConfig, model, source="model config"), from_dict(
        TrainConfig, train, source="train config"
    )


def write_run_config(run_dir: Path, model_config: ModelConfig, cfg: TrainConfig) -> None:
    """``config.json`` of the run folder: the configs the run trains with."""
    tmp = run_dir / ".config.json.tmp"
    tmp.write_text(json.dumps({"model": to_dict(model_config), "train": to_dict(cfg)}, indent=2) + "\n")
    os.replace(tmp, run_dir / "config.json")
