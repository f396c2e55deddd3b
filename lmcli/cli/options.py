"""Command-line flags derived from the config dataclasses, so each option is declared once.

``@config_options(TrainConfig, ModelConfig)`` on a Typer command adds one flag per config field
(``--max-steps``, ``--block-size``, ...) with the field's help, default and choices, and hands
the command the values the user actually gave as ``options: dict[str, Any]``. Defaults are not
filled in here: a value left out falls back to a config file, a resumed run, or the dataclass.
A config's sections (``TrainConfig.optim``, ...) give flat flags too, listed in ``--help``
under the section's ``TITLE`` (a config's own ``TITLE``, as ``ModelConfig``'s, heads its fields).

Why not tyro or jsonargparse: both would replace Typer (a chosen dependency) and change what
users rely on: flag spellings such as ``--untie-embeddings`` and ``-o``, the one-line error
format, and lmcli's precedence of dataclass < resumed run < ``--config`` file < flags.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, get_origin

import typer

from lmcli.config.fields import choices_of, flag_name, option_fields, split_optional
from lmcli.config.files import sections_of


def _cli_type(tp: Any, meta: dict[str, Any]) -> Any:
    """The type Typer parses a field's flag as (always optional: None means not given)."""
    base, _ = split_optional(tp)
    if meta.get("parse") is not None or choices_of(tp) is not None:
        return str | None  # converted or checked by the config, with the config's own message
    if get_origin(base) is tuple:
        return list[str] | None
    return base | None


def _help(f: dataclasses.Field, tp: Any) -> str:
    """The field's help with its default (``[default: ...]``)."""
    meta = f.metadata
    default = meta.get("default_help")
    if default is None and f.default not in (None, "", ()):
        if isinstance(f.default, bool):
            flags = (meta.get("flag") or f"--{flag_name(f.name)}/--no-{flag_name(f.name)}").split("/")
            default = flags[0] if f.default else flags[-1]
        else:
            default = f.default
    return f"{meta['help']} [default: {default}]" if default is not None else meta["help"]


def _parameter(f: dataclasses.Field, tp: Any, heading: str | None) -> inspect.Parameter:
    """One Typer parameter (an option, or an argument) for config field ``f``, listed in
    ``--help`` under ``heading`` (None: with the command's own options)."""
    meta = f.metadata
    annotation = _cli_type(tp, meta)
    if meta["argument"]:
        info = typer.Argument(None, help=meta["help"], show_default=False, metavar=f.name)
    else:
        base, _ = split_optional(tp)
        if base is bool:
            decls = [meta.get("flag") or f"--{flag_name(f.name)}/--no-{flag_name(f.name)}"]
        else:
            decls = [meta.get("flag") or f"--{flag_name(f.name)}"]
        if meta.get("short"):
            decls.append(meta["short"])
        choices = choices_of(tp)
        metavar = "[" + "|".join(choices) + "]" if choices else None
        info = typer.Option(
            None, *decls, help=_help(f, tp), show_default=False, metavar=metavar, rich_help_panel=heading
        )
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def config_fields(
    *classes: type, exclude: tuple[str, ...] = ()
) -> list[tuple[dataclasses.Field, Any, str | None]]:
    """(field, type, heading in --help) of every command-line field of ``classes`` and their
    sections, in declaration order."""
    out, seen = [], set(exclude)
    for cls in classes:
        for section, f, tp in option_fields(cls):
            if f.name in seen or not f.metadata.get("cli", True):
                continue
            seen.add(f.name)
            out.append((f, tp, _heading(cls, section)))
    return out


def _heading(cls: type, section: str | None) -> str | None:
    """Where --help lists a field: its section's ``TITLE``, else its config's (if it has one)."""
    if section is not None:
        return sections_of(cls)[section].TITLE
    return getattr(cls, "TITLE", None)


def config_options(*classes: type, exclude: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Give a command one flag per field of ``classes``; it receives ``options`` (given values).

    The decorated function declares its own parameters (run folder, I/O flags) and one named
    ``options``; the flags generated here follow its own parameters in ``--help``.
    """
    generated = [_parameter(f, tp, heading) for f, tp, heading in config_fields(*classes, exclude=exclude)]
    names = [p.name for p in generated]

    def decorate(fn: Callable) -> Callable:
        hints = typing.get_type_hints(fn)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(fn).parameters.values()
            if p.name != "options"
        ]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            given = {}
            for name in names:
                value = kwargs.pop(name)
                if value is not None and value != [] and value != ():
                    given[name] = tuple(value) if isinstance(value, list) else value
            return fn(**kwargs, options=given)

        params = own + generated
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
