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

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as _typer_click
except ImportError:  # pragma: no cover - older typer uses click itself
    _typer_click = click.exceptions

_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, _typer_click.ClickException)

from lmcli import __version__
from lmcli.errors import LmcliError

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
