"""The ``lmcli`` command: the Typer app, its commands registered from their modules, and
``main``, which turns every error into one line and an exit code.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
import typer
from typer.core import TyperCommand

from lmcli import __version__
from lmcli.cli import chat, decode, evaluate, files, serve, train
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


class SectionedCommand(TyperCommand):
    """Plain help as every command's, with options grouped under headings: a config section's
    title (``rich_help_panel``, set by ``lmcli.cli.options``), the command's own under Options."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        groups: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                argument = param.param_type_name == "argument"
                heading = "Arguments" if argument else getattr(param, "rich_help_panel", None) or "Options"
                groups.setdefault(heading, []).append(record)
        for heading, rows in groups.items():
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)


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
    lmcli eval    RUN_DIR       perplexity and bits per byte, or scores on downstream tasks
    lmcli tokenize CORPUS... -o DIR   tokenize a large corpus into shards, on every core
    lmcli sample  [RUN_DIR]     generate text (temperature, top-k, top-p, ...)
    lmcli beam    [RUN_DIR]     beam search, e.g. translation
    lmcli export  RUN_DIR OUT   a Hugging Face folder (GPT-2, Llama or Qwen2) or a GGUF file
    lmcli imatrix RUN_DIR TEXT  an importance matrix for quantized GGUF export
    lmcli average RUN_DIR       average a run's last saved checkpoints into a new one
    lmcli serve   [RUN_DIR]     an OpenAI-compatible server and a chat page
    lmcli chat    [RUN_DIR]     chat in the terminal, or answer messages JSON on stdin
    lmcli verify  RUN_DIR       check a run folder, a Hugging Face folder or a GGUF file
    """


# the commands, in the order `lmcli --help` lists them
app.command(cls=SectionedCommand)(train.train)
app.command(cls=SectionedCommand)(train.tokenize)
app.command()(decode.sample)
app.command()(decode.beam)
app.command("eval")(evaluate.eval_command)
app.command()(files.export)
app.command()(files.imatrix)
app.command()(train.average)
app.command()(serve.serve)
app.command()(chat.chat)
app.command()(files.verify)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point with one-line errors and conventional exit codes."""
    debug = os.environ.get("LMCLI_DEBUG") == "1"
    try:
        code = app(args=argv, standalone_mode=False)  # an exit code when a command exits early
        if isinstance(code, int) and code:
            sys.exit(code)
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
