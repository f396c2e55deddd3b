"""Configs as dictionaries and files: to and from JSON-like dicts, TOML config files, the
fields a checkpoint stores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any

from lmcli.config.fields import C, field_types, is_section, option_fields
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.safe_io import parse_json, read_input

CONFIG_BYTES = 1 << 20  # a --config file (a recipe: a few KiB)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass, flat: one key per option, sections included
    (the form of flags, of ``config.json`` and of old TOML files)."""
    return {f.name: list(v) if isinstance(v, tuple) else v for f, v in option_items(cfg)}


def option_items(cfg: Any) -> list[tuple[dataclasses.Field, Any]]:
    """Every option of a config with its value, its sections' flattened."""
    return [
        (f, getattr(getattr(cfg, section) if section else cfg, f.name))
        for section, f, _ in option_fields(type(cfg))
    ]


def _build(cls: type[C], data: dict[str, Any]) -> C:
    """``cls`` from flat options, each section built from its own."""
    hints = field_types(cls)
    kwargs = {}
    for f in fields(cls):
        if is_section(hints[f.name]):
            own = field_names(hints[f.name])
            kwargs[f.name] = _build(hints[f.name], {k: v for k, v in data.items() if k in own})
        elif f.name in data:
            kwargs[f.name] = data[f.name]
    return cls(**kwargs)


def from_dict(cls: type[C], data: dict[str, Any], *, source: str = "config") -> C:
    """Build ``cls`` from a flat dict of options, with a one-line error for unknown keys or wrong
    types. ``from_dict(TrainConfig, {"lr": 3e-4, "max_steps": 100})``: each option goes to its
    section."""
    unknown = sorted(set(data) - field_names(cls))
    if unknown:
        raise LmcliError(f"{source}: unknown option(s) {', '.join(unknown)}")
    try:
        return _build(cls, data)
    except TypeError as exc:
        raise LmcliError(f"{source}: {exc}") from None


def replace_options(cfg: C, **options: Any) -> C:
    """``dataclasses.replace`` by flat option names: ``replace_options(cfg, lora_rank=0)``
    replaces ``cfg.lora.lora_rank``. Every check runs again."""
    unknown = sorted(set(options) - field_names(type(cfg)))
    if unknown:
        raise LmcliError(f"unknown option(s) {', '.join(unknown)}")
    changes: dict[str, Any] = {}
    for section, f, _ in option_fields(type(cfg)):
        if f.name not in options:
            continue
        if section is None:
            changes[f.name] = options[f.name]
        else:
            changes.setdefault(section, {})[f.name] = options[f.name]
    for name in sections_of(type(cfg)):
        if name in changes:
            changes[name] = dataclasses.replace(getattr(cfg, name), **changes[name])
    return dataclasses.replace(cfg, **changes)


def stored_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The options of a config read from a run folder that may be used (``stored=True``); an
    option the folder predates gets the value it had then (``absent``)."""
    declared = [f for _, f, _ in option_fields(cls)]
    dropped = {f.name for f in declared if not f.metadata.get("stored", True)}
    kept = {k: v for k, v in data.items() if k not in dropped}
    for f in declared:
        if f.name not in data and f.metadata.get("absent") is not None:
            kept[f.name] = f.metadata["absent"]
    return kept


def stored_model_config(data: dict[str, Any], *, source: str) -> ModelConfig:
    """The ModelConfig a run folder's ``config.json`` holds; an option the folder predates gets
    the value it had then (``absent``: e.g. no vocabulary padding)."""
    return from_dict(ModelConfig, stored_fields(ModelConfig, data), source=source)


def resolve_vocab_multiple(cfg: ModelConfig, device_type: str) -> ModelConfig:
    """``--vocab-multiple auto`` (0) made concrete for a run training on ``device_type``: 64 on
    CUDA (tensor-core-friendly matmul shapes), 1 elsewhere (on a CPU the slice to the logical
    vocabulary costs a copy of the logits, and a small vocabulary would grow: 65 chars -> 128)."""
    if cfg.vocab_multiple:
        return cfg
    return dataclasses.replace(cfg, vocab_multiple=64 if device_type == "cuda" else 1)


def field_names(cls: type) -> set[str]:
    """The flat names of a config's options (its sections' included)."""
    return {f.name for _, f, _ in option_fields(cls)}


def sections_of(cls: type) -> dict[str, type]:
    """A config's sections by attribute name (``TrainConfig``: data, optim, ...)."""
    hints = field_types(cls)
    return {f.name: hints[f.name] for f in fields(cls) if is_section(hints[f.name])}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON) config file into a flat ``{option: value}`` dict.

    Keys may use dashes or underscores. They may sit at the top level, under ``[model]`` /
    ``[train]`` tables, or under a section of ``TrainConfig`` (``[optim]``, ``[schedule]``, ...,
    also as ``[train.optim]``), which must then hold only that section's options.
    """
    path = Path(path)
    raw = read_input(path, CONFIG_BYTES, "config file")
    try:
        if path.suffix == ".json":
            data = parse_json(raw, f"config file {path}")
        else:
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LmcliError(f"cannot parse config file {path}: {exc}") from None
    except RecursionError:
        raise LmcliError(f"cannot parse config file {path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise LmcliError(f"config file {path} must hold a table of options")
    return _flatten_tables(data, f"config file {path}", tables=("model", "train"))


def _flatten_tables(table: dict[str, Any], where: str, tables: tuple[str, ...]) -> dict[str, Any]:
    """A config file's options, flat: the tables named ``tables`` and TrainConfig's sections
    opened; a section's table may hold only its own options."""
    sections = sections_of(TrainConfig)
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if isinstance(value, dict) and name in tables:
            flat.update(_flatten_tables(value, where, tables=()))
        elif isinstance(value, dict) and name in sections:
            inner = {k.replace("-", "_"): v for k, v in value.items()}
            strays = sorted(set(inner) - field_names(sections[name]))
            if strays:
                raise LmcliError(f"{where}: [{key}] has no option(s) {', '.join(strays)}")
            flat.update(inner)
        else:
            flat[name] = value
    return flat


def split_options(
    options: dict[str, Any], *, source: str = "options"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a flat option dict into (model fields, train fields); unknown keys are an error.

    ``vocab_size`` belongs to the train config (the tokenizer's target size); the model's
    vocabulary always comes from the tokenizer.
    """
    model_names = field_names(ModelConfig) - {"vocab_size"}
    train_names = field_names(TrainConfig)
    unknown = sorted(set(options) - model_names - train_names)
    if unknown:
        raise LmcliError(f"{source}: unknown option(s) {', '.join(unknown)}")
    model = {k: v for k, v in options.items() if k in model_names}
    train = {k: v for k, v in options.items() if k in train_names}
    return model, train
