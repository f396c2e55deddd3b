"""``lmcli train``, ``lmcli tokenize`` and ``lmcli average``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from lmcli.cli.common import build
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    AverageConfig,
    TokenizeConfig,
)
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import Terminated


@config_options(TrainConfig, ModelConfig)
def train(
    config: Path | None = typer.Option(
        None, "--config", help="TOML (or JSON) file of options; flags override it."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this folder where it stopped."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No pre-flight table or progress bar."),
    *,
    options: dict[str, Any],
) -> None:
    """Train a decoder-only Transformer on a corpus (the built-in one when none is given).

    With --task translation it trains on parallel text (--source/--target files, one TSV/JSONL
    file, or --dataset), each pair as "<bos> source <sep> target <eos>" with the loss on the target.
    """
    from lmcli.config.files import load_config_file
    from lmcli.train import resolve_configs
    from lmcli.train import train as run_training
    from lmcli.train.display import rich_reporter

    file_options = load_config_file(config) if config else {}
    model_cfg, train_cfg = resolve_configs(file_options, options, resume=resume)
    try:
        result = run_training(
            model_cfg, train_cfg, resume=resume, reporter=rich_reporter(quiet), progress=not quiet
        )
    except Terminated:  # a SIGTERM before training began: cleaned up as a Ctrl-C is
        raise typer.Exit(143) from None
    if result.stopped in ("SIGINT", "SIGTERM"):
        raise typer.Exit(130 if result.stopped == "SIGINT" else 143)


@config_options(
    TokenizeConfig,
    exclude=(
        *("val", "val_fraction", "align_documents", "document_mask", "distill_loss", "distill_beta"),
        *("distill_alpha", "on_policy", "on_policy_tokens", "init_from_teacher_layers", "student_layers"),
    ),
)
def tokenize(
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    *,
    options: dict[str, Any],
) -> None:
    """Tokenize a corpus into a folder of token shards, on every core; `lmcli train DIR` trains on it.

    Reads what `lmcli train` reads (files, folders, globs, .gz/.zst, JSONL/parquet columns,
    --dataset in streaming mode) in flat memory. Run again after an interruption: finished
    shards are kept and the rest is done.
    """
    import time

    from lmcli.data.token_cache import tokenize_to

    t0 = time.perf_counter()
    cfg = build(TokenizeConfig, options)
    logits = None
    if cfg.distill.teacher:  # the teacher's tokenizer, then its logits beside the shards
        from lmcli.train.post.teacher_logits import tokenize_with_teacher

        folder, logits = tokenize_with_teacher(cfg, progress=not quiet)
    else:
        folder = tokenize_to(cfg, progress=not quiet)
    if quiet:
        return
    index, seconds = folder.index, time.perf_counter() - t0
    done = "already tokenized" if folder.cached else f"{index['bytes'] / 1e6 / seconds:.2f} MB/s"
    print(
        f"{index['n_tokens']:,} tokens ({index['documents']:,} document(s), {index['bytes']:,} bytes) "
        f"in {len(index['shards'])} shard(s) of {index['dtype']}: {folder.path} ({done})",
        file=sys.stderr,
    )
    if logits is not None:
        print(
            f"teacher logits: {logits.label} of every position in chunks of {logits.context} tokens, "
            f"{logits.bytes_per_token} bytes a token ({time.perf_counter() - t0:.1f} s in all)",
            file=sys.stderr,
        )


@config_options(AverageConfig)
def average(
    run_dir: Path = typer.Argument(..., help="Run folder with step-N checkpoints (--keep-last)."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Checkpoint folder to write (new). [default: RUN/average-last-N]"
    ),
    *,
    options: dict[str, Any],
) -> None:
    """Average the weights of a run's last N saved checkpoints into a new checkpoint folder."""
    from lmcli.train.averaging import average_checkpoints

    cfg = build(AverageConfig, options)
    typer.echo(f"wrote {average_checkpoints(run_dir, cfg.last, out)}")
