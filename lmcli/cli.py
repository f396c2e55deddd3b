"""The `lmcli` command line: each command turns options into a config and calls the library.

Errors the user can fix (``LmcliError``, bad option values, OS errors) print one line to stderr
and exit with code 2; nothing prints a traceback unless LMCLI_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click
import typer

from lmcli import __version__
from lmcli.errors import LmcliError

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as _typer_click
except ImportError:  # pragma: no cover - older typer uses click itself
    _typer_click = click.exceptions

_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, _typer_click.ClickException)

app = typer.Typer(
    name="lmcli",
    help="Train and use decoder-only Transformer language models.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Train and use decoder-only Transformer language models.

    \b
    lmcli train   [CORPUS...]   train a model (built-in corpus when none is given)
    lmcli eval    RUN_DIR       perplexity and bits per byte on held-out text
    lmcli sample  [RUN_DIR]     generate text (temperature, top-k, top-p, ...)
    lmcli beam    [RUN_DIR]     beam search, e.g. translation
    """


def given(**options: Any) -> dict[str, Any]:
    """The options the user actually gave (CLI options default to None)."""
    return {k: v for k, v in options.items() if v is not None and v != ()}


def _help(text: str, cls: type, name: str) -> str:
    """Option help with the dataclass default, so help and library never drift."""
    from lmcli.config import default_of

    default = default_of(cls, name)
    return f"{text} [default: {default}]" if default not in (None, "", ()) else text


_M = "ModelConfig"
_T = "TrainConfig"


def _cfg(kind: str) -> type:
    from lmcli import config

    return getattr(config, kind)


@app.command()
def train(
    corpus: list[str] | None = typer.Argument(
        None, help="Text files, folders (recursive), globs or .gz files. None: a built-in corpus."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="TOML (or JSON) file of options; flags override it."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this folder where it stopped."
    ),
    out: str | None = typer.Option(None, "--out", "-o", help="Run folder. [default: checkpoints/run-<time>]"),
    task: str | None = typer.Option(
        None, help=_help("lm (language modelling) or translation (source <sep> target).", _cfg(_T), "task")
    ),
    source: str | None = typer.Option(None, help="Translation: line-aligned source file (.gz allowed)."),
    target: str | None = typer.Option(None, help="Translation: line-aligned target file (.gz allowed)."),
    source_field: str | None = typer.Option(
        None,
        help=_help(
            "Translation: TSV/JSONL/dataset column or language of the source.", _cfg(_T), "source_field"
        ),
    ),
    target_field: str | None = typer.Option(
        None, help=_help("Translation: column or language of the target.", _cfg(_T), "target_field")
    ),
    val_source: str | None = typer.Option(None, help="Translation: validation source file."),
    val_target: str | None = typer.Option(None, help="Translation: validation target file."),
    prefix_lm: bool | None = typer.Option(
        None, "--prefix-lm/--no-prefix-lm", help="Translation: source tokens attend to each other both ways."
    ),
    dataset: str | None = typer.Option(
        None, help="Hugging Face dataset NAME[:CONFIG] (or a local data file)."
    ),
    text_column: str | None = typer.Option(
        None, help=_help("Dataset column holding the text.", _cfg(_T), "text_column")
    ),
    split: str | None = typer.Option(None, help=_help("Dataset split to train on.", _cfg(_T), "split")),
    val: str | None = typer.Option(None, help="Validation corpus (file, folder or glob) instead of a split."),
    val_fraction: float | None = typer.Option(
        None, help=_help("Last fraction of the corpus kept for validation.", _cfg(_T), "val_fraction")
    ),
    tokenizer: str | None = typer.Option(
        None,
        help=_help(
            "char, byte, bpe (trained on the corpus) or a tokenizer.json path.", _cfg(_T), "tokenizer"
        ),
    ),
    vocab_size: int | None = typer.Option(
        None, help=_help("Vocabulary size for bpe.", _cfg(_T), "vocab_size")
    ),
    cache_dir: str | None = typer.Option(
        None, help="Token cache folder. [default: ~/.cache/lmcli or $LMCLI_CACHE]"
    ),
    init_from: str | None = typer.Option(
        None, help="Start from a local Hugging Face GPT-2 folder (fine-tuning)."
    ),
    block_size: int | None = typer.Option(
        None, help=_help("Context length in tokens.", _cfg(_M), "block_size")
    ),
    n_layer: int | None = typer.Option(None, help=_help("Transformer blocks.", _cfg(_M), "n_layer")),
    n_head: int | None = typer.Option(None, help=_help("Attention heads.", _cfg(_M), "n_head")),
    n_embd: int | None = typer.Option(None, help=_help("Embedding width.", _cfg(_M), "n_embd")),
    d_ff: int | None = typer.Option(None, help="MLP width. [default: 4*n-embd, ~8/3*n-embd for swiglu]"),
    dropout: float | None = typer.Option(None, help=_help("Dropout rate.", _cfg(_M), "dropout")),
    position: str | None = typer.Option(
        None, help=_help("Positions: learned, sinusoidal, rope or alibi.", _cfg(_M), "position")
    ),
    mlp: str | None = typer.Option(None, help=_help("Feed-forward: gelu, relu or swiglu.", _cfg(_M), "mlp")),
    norm: str | None = typer.Option(
        None, help=_help("Normalization: layernorm or rmsnorm.", _cfg(_M), "norm")
    ),
    norm_placement: str | None = typer.Option(
        None, help=_help("Norm before (pre) or after (post) each sublayer.", _cfg(_M), "norm_placement")
    ),
    untie_embeddings: bool = typer.Option(
        False, "--untie-embeddings", help="Separate input and output embeddings."
    ),
    no_bias: bool = typer.Option(False, "--no-bias", help="No biases in linear layers and LayerNorm."),
    batch_size: int | None = typer.Option(
        None, help=_help("Sequences per micro-batch.", _cfg(_T), "batch_size")
    ),
    grad_accum: int | None = typer.Option(
        None, help=_help("Micro-batches per optimizer step.", _cfg(_T), "grad_accum")
    ),
    max_steps: int | None = typer.Option(
        None, help="Stop after this many steps. [default: 2000 if no other limit]"
    ),
    epochs: float | None = typer.Option(None, help="Stop after this many passes over the corpus."),
    max_time: str | None = typer.Option(None, help="Stop (with a checkpoint) after this long: 90s, 30m, 2h."),
    lr: float | None = typer.Option(None, help=_help("Peak learning rate.", _cfg(_T), "lr")),
    min_lr_ratio: float | None = typer.Option(
        None, help=_help("Cosine floor as a fraction of --lr.", _cfg(_T), "min_lr_ratio")
    ),
    warmup_steps: int | None = typer.Option(
        None, help=_help("Linear warmup steps.", _cfg(_T), "warmup_steps")
    ),
    weight_decay: float | None = typer.Option(
        None, help=_help("AdamW weight decay (matrices only).", _cfg(_T), "weight_decay")
    ),
    beta1: float | None = typer.Option(None, help=_help("AdamW beta1.", _cfg(_T), "beta1")),
    beta2: float | None = typer.Option(None, help=_help("AdamW beta2.", _cfg(_T), "beta2")),
    grad_clip: float | None = typer.Option(
        None, help=_help("Clip the gradient norm to this (0: off).", _cfg(_T), "grad_clip")
    ),
    eval_interval: int | None = typer.Option(
        None, help=_help("Validate every N steps.", _cfg(_T), "eval_interval")
    ),
    eval_batches: int | None = typer.Option(
        None, help=_help("Validation batches per evaluation.", _cfg(_T), "eval_batches")
    ),
    save_interval: int | None = typer.Option(
        None, help="Checkpoint every N steps. [default: at every validation]"
    ),
    keep_last: int | None = typer.Option(
        None, help=_help("Periodic step-N checkpoints to keep besides last and best.", _cfg(_T), "keep_last")
    ),
    log_interval: int | None = typer.Option(
        None, help=_help("Log metrics every N steps.", _cfg(_T), "log_interval")
    ),
    seed: int | None = typer.Option(
        None, help=_help("Random seed (weights, data order, dropout).", _cfg(_T), "seed")
    ),
    device: str | None = typer.Option(None, help=_help("auto, cpu, cuda or mps.", _cfg(_T), "device")),
    dtype: str | None = typer.Option(
        None, help=_help("auto (bf16 autocast on CUDA), float32, bfloat16, float16.", _cfg(_T), "dtype")
    ),
    compile: bool | None = typer.Option(None, "--compile/--no-compile", help="torch.compile the model."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No pre-flight table or progress bar."),
) -> None:
    """Train a decoder-only Transformer on a corpus (the built-in one when none is given).

    With --task translation it trains on parallel text (--source/--target files, one TSV/JSONL
    file, or --dataset), each pair as "<bos> source <sep> target <eos>" with the loss on the target.
    """
    from lmcli.config import load_config_file
    from lmcli.display import rich_reporter
    from lmcli.train import resolve_configs
    from lmcli.train import train as run_training

    options = given(
        task=task,
        source=source,
        target=target,
        source_field=source_field,
        target_field=target_field,
        val_source=val_source,
        val_target=val_target,
        prefix_lm=prefix_lm,
        corpus=tuple(corpus or ()),
        dataset=dataset,
        text_column=text_column,
        split=split,
        val=val,
        val_fraction=val_fraction,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        out=out,
        cache_dir=cache_dir,
        init_from=init_from,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        d_ff=d_ff,
        dropout=dropout,
        position=position,
        mlp=mlp,
        norm=norm,
        norm_placement=norm_placement,
        batch_size=batch_size,
        grad_accum=grad_accum,
        max_steps=max_steps,
        epochs=epochs,
        max_time=max_time,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        grad_clip=grad_clip,
        eval_interval=eval_interval,
        eval_batches=eval_batches,
        save_interval=save_interval,
        keep_last=keep_last,
        log_interval=log_interval,
        seed=seed,
        device=device,
        dtype=dtype,
        compile=compile,
    )
    if untie_embeddings:
        options["tie_embeddings"] = False
    if no_bias:
        options["bias"] = False
    file_options = load_config_file(config) if config else {}
    model_cfg, train_cfg = resolve_configs(file_options, options, resume=resume)
    result = run_training(
        model_cfg, train_cfg, resume=resume, reporter=rich_reporter(quiet), progress=not quiet
    )
    if result.stopped in ("SIGINT", "SIGTERM"):
        raise typer.Exit(130 if result.stopped == "SIGINT" else 143)


# --- commands are defined below; each is a few lines: options -> config -> library call ---


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point with one-line errors and conventional exit codes."""
    debug = os.environ.get("LMCLI_DEBUG") == "1"
    try:
        app(args=argv, standalone_mode=False)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _ABORT:
        print("error: aborted", file=sys.stderr)
        sys.exit(130)
    except _USAGE as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `lmcli`: show the help
            print(exc.format_message())
            sys.exit(0)
        if debug:
            raise
        print(f"error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except LmcliError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:
        if debug:
            raise
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # a bug: still one line, with a way to see more
        if debug:
            raise
        print(
            f"error: internal error: {type(exc).__name__}: {exc} (set LMCLI_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        sys.exit(1)


def run_dir_or_latest(run_dir: Path | None) -> Path:
    """The given run folder, or the newest one under ``checkpoints/``."""
    from lmcli.checkpoint import find_latest_run

    return run_dir if run_dir is not None else find_latest_run(Path("checkpoints"))
