"""``lmcli export`` and ``lmcli verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from lmcli.cli.common import build
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    ExportConfig,
)
from lmcli.errors import LmcliError


@config_options(ExportConfig)
def export(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder, Hugging Face folder or GGUF file."),
    out_dir: Path | None = typer.Argument(
        None, help="Folder (hf, must be new or empty) or file (gguf, must be new) to write."
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="The same as OUT_DIR. [default for gguf: RUN-DTYPE.gguf here]"
    ),
    *,
    options: dict[str, Any],
) -> None:
    """Export a checkpoint: a Hugging Face folder that from_pretrained loads, a GGUF file for llama.cpp,
    or (a LoRA run, --merge) a plain lmcli checkpoint."""
    cfg = build(ExportConfig, options)
    if out_dir is not None and out is not None and out_dir != out:
        raise LmcliError("give the output once: as OUT or as --out")
    target = out_dir if out_dir is not None else out
    from lmcli.formats.lora_base import is_lora_run
    from lmcli.formats.sources import export_checkpoint

    if is_lora_run(run_dir) != cfg.merge:
        raise LmcliError(
            f"{run_dir} is a LoRA run: give --merge to fold its adapters into the weights"
            if not cfg.merge
            else f"--merge: {run_dir} has no LoRA adapters to fold"
        )
    if cfg.format == "lmcli":
        if target is None:
            raise LmcliError("give the folder to write (OUT or --out)")
        typer.echo(f"wrote {export_checkpoint(run_dir, target)}")
        return
    if cfg.format == "gguf":
        from lmcli.formats.export.gguf import export_gguf

        typer.echo(f"wrote {export_gguf(run_dir, target, cfg.gguf_type)}")
        return
    from lmcli.formats.export.hf import export_hf

    if target is None:
        raise LmcliError("give the folder to write (OUT or --out)")
    typer.echo(f"wrote {export_hf(run_dir, target)}")


def verify(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder, Hugging Face folder or GGUF file."),
) -> None:
    """Check a model without building it: a run folder's files, links, checksums, configs, weight
    shapes and sizes against the config, tokenizer, trainer state, LoRA adapters; a Hugging Face
    folder's config, tokenizer and shards; a GGUF file's header and tensors. One line per
    checkpoint."""
    from lmcli.formats.verify import verify_run

    for report in verify_run(run_dir):
        typer.echo(report.line())
