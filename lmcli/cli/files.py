"""``lmcli export``, ``lmcli imatrix`` and ``lmcli verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from lmcli.cli.common import build
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    ExportConfig,
    ImatrixConfig,
)
from lmcli.errors import LmcliError
from lmcli.safe_io import new_file


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
        from lmcli.device import set_threads
        from lmcli.formats.export.calibrate import importance_matrix
        from lmcli.formats.export.gguf import export_gguf

        set_threads(cfg.threads)
        if target is not None:
            new_file(target)  # (before an importance matrix is computed)
        imatrix = importance_matrix(cfg.imatrix, run_dir) if cfg.imatrix else None
        typer.echo(f"wrote {export_gguf(run_dir, target, cfg.gguf_type, imatrix)}")
        return
    from lmcli.formats.export.hf import export_hf

    if target is None:
        raise LmcliError("give the folder to write (OUT or --out)")
    typer.echo(f"wrote {export_hf(run_dir, target)}")


@config_options(ImatrixConfig)
def imatrix(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder, Hugging Face folder or GGUF file."),
    text: Path = typer.Argument(
        ..., help="Calibration text (UTF-8), e.g. a few hundred KB of what the model reads."
    ),
    *,
    options: dict[str, Any],
) -> None:
    """An importance matrix: per matrix of the model, the per-column sums of squares of its inputs
    over a calibration text, in llama.cpp's imatrix GGUF layout (export --imatrix and
    llama-quantize --imatrix take it)."""
    from lmcli.device import pick_device, set_threads
    from lmcli.formats.export.calibrate import imatrix_of_source
    from lmcli.formats.gguf.imatrix import write_imatrix

    cfg = build(ImatrixConfig, options)
    set_threads(cfg.threads)
    new_file(cfg.out)  # (before the model runs)
    matrix = imatrix_of_source(run_dir, text, pick_device(cfg.device), cfg.context, cfg.batch_size)
    out = write_imatrix(matrix, cfg.out)
    windows = f"{matrix.chunk_count} windows of {matrix.chunk_size} tokens"
    typer.echo(f"wrote {out} ({len(matrix.sums)} matrices, {windows})")


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
