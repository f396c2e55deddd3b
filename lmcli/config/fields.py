"""Option machinery: how a dataclass field becomes a checked option (``option``), the
parsers of durations, sizes and selections, and the ranges every option is held to.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

from lmcli.errors import LmcliError

Device = Literal["auto", "cpu", "cuda", "mps"]


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


# --select: these, or task:NAME:METRIC (translation computes BLEU and chrF, dpo the preference
# accuracy and margin, grpo the reward and pass@1: tasks.Task.metrics)
SELECT_METRICS = (
    "val_loss",
    "val_bleu",
    "val_chrf",
    "val_accuracy",
    "val_margin",
    "val_reward",
    "val_pass@1",
)
TASK_SCORES = ("acc", "acc_norm", "exact_match")  # an --eval-task's scores --select may follow
INT_LIMIT = 1 << 63  # integer options fit in 64 bits (torch and numpy)


VOCAB_MULTIPLE_MAX = 1024  # --vocab-multiple: a larger one only wastes rows


SEED_MAX = (1 << 63) - 1  # seed + a rank or sample index stays in the range torch.manual_seed takes


MIN_TEMPERATURE = 1e-6  # the smallest positive temperature: below, logits / T overflows float32


C = TypeVar("C")


def option(
    default: Any,
    help: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    flag: str | None = None,
    short: str | None = None,
    default_help: str | None = None,
    argument: bool = False,
    cli: bool = True,
    parse: Any = None,
    path: bool = False,
    resume: Literal["fixed", "free", "derived", "data"] | None = None,
    stored: bool = True,
    absent: Any = None,
) -> Any:
    """A config field with everything the CLI, the checks and resume need to know about it.

    ``gt/ge/lt/le``: the allowed range (None allowed when the default is None). ``flag``: the
    flag's spelling when not ``--field-name`` (``--a/--b`` for a boolean's on/off pair);
    ``short``: a one-letter alias. ``default_help``: how help shows the default when the value
    itself says little. ``argument``: a positional argument. ``cli=False``: not a flag at all.
    ``parse``: converts text (a flag's or a TOML string) to the field's type. ``path``: a local
    path, stored absolute so the run works from any folder. ``resume``: whether ``--resume``
    may change it (``free``), must keep it (``fixed``), takes it from the data (``derived``), or
    changes it only with ``--allow-new-data`` (``data``: what the run trains on); None: the
    config's own rule (a ModelConfig field is fixed, a TrainConfig field free).
    ``stored=False``: a run folder's stored value is never used (resume, eval): a path lmcli
    writes to comes from this machine's flags or defaults, not from a run folder someone shared.
    ``absent``: the value a run folder written before the option existed had in effect (when it
    differs from today's default).
    """
    meta = {
        "help": help,
        "range": (gt, ge, lt, le),
        "flag": flag,
        "short": short,
        "default_help": default_help,
        "argument": argument,
        "cli": cli,
        "parse": parse,
        "path": path,
        "resume": resume,
        "stored": stored,
        "absent": absent,
    }
    return dataclasses.field(default=default, metadata=meta)


def parse_duration(value: str | float | int) -> float:
    """Seconds from 5400, '90s', '30m', '2h' or '1h30m'."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        raise LmcliError(f"invalid duration {value!r}: use e.g. 90s, 30m, 2h or 1h30m")
    text = value.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise LmcliError(f"invalid duration {value!r}: use e.g. 90s, 30m, 2h or 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def parse_size(value: str | int) -> int:
    """Bytes from 1048576, '512MiB', '2GiB', '300MB' or '64KiB' (0: none)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
    }
    match = (
        re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value.strip().lower()) if isinstance(value, str) else None
    )
    if match is None or match.group(2) not in units:
        raise LmcliError(f"invalid size {value!r}: use e.g. 512MiB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * units[match.group(2)])


def parse_select(value: str) -> str:
    """A ``--select`` value: a validation metric, or ``task:NAME:METRIC``, the score METRIC of the
    ``--eval-task`` named NAME (whether NAME is one is ``TrainConfig``'s check)."""
    if value in SELECT_METRICS:
        return value
    parts = value.split(":")
    if len(parts) == 3 and parts[0] == "task" and parts[1] and parts[2] in TASK_SCORES:
        return value
    if len(parts) == 3 and parts[0] == "task" and parts[1] and parts[2] == "perplexity":
        raise LmcliError(f"--select {value}: best/ follows a score that grows; choose acc")
    raise LmcliError(
        f"invalid select {value!r}: choose one of {', '.join(SELECT_METRICS)}, or task:NAME:METRIC "
        f"(an --eval-task's {', '.join(TASK_SCORES)})"
    )


def task_name(path: str | os.PathLike) -> str:
    """The name a downstream task file goes by (``--select task:NAME:...``, metrics, tables):
    its file name without ``.jsonl``/``.json`` and ``.gz``."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def parse_vocab_multiple(value: str | int) -> int:
    """``auto`` -> 0 (resolved by training), or a whole number."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return 0
        if not re.fullmatch(r"-?\d+", text):
            raise LmcliError(f"invalid vocab-multiple {value!r}: give auto or a whole number such as 64")
        return int(text)
    return value


def flag_name(name: str) -> str:
    """How messages name a field: ``max_steps`` -> ``max-steps``."""
    return name.replace("_", "-")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Each field's resolved type annotation."""
    return typing.get_type_hints(cls)


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); any other type -> (type, False)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The allowed values of a ``Literal`` type, else None."""
    tp, _ = split_optional(tp)
    return get_args(tp) if get_origin(tp) is Literal else None


def _describe(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(tp, str(tp))


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, or a one-line error; paths become text, ints numbers."""
    base, optional = split_optional(tp)
    if value is None:
        if optional:
            return None
        raise LmcliError(f"{flag_name(name)} must be {_describe(base)}, got nothing")
    if get_origin(base) is Literal:
        allowed = get_args(base)
        if value not in allowed:
            raise LmcliError(f"invalid {flag_name(name)} {value!r}: choose one of {', '.join(allowed)}")
        return value
    if get_origin(base) is tuple:  # tuple[str, ...]
        items = [value] if isinstance(value, str | os.PathLike) else value
        if not isinstance(items, list | tuple) or not all(isinstance(v, str | os.PathLike) for v in items):
            raise LmcliError(f"{flag_name(name)} must be a list of text, got {value!r}")
        return tuple(str(v) for v in items)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str | os.PathLike),
    }.get(base, True)
    if not ok:
        raise LmcliError(f"{flag_name(name)} must be {_describe(base)}, got {value!r}")
    if base is float:
        return float(value)
    if base is str:
        return str(value)
    return value


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _check_range(name: str, value: float, bounds: tuple[float | None, ...]) -> None:
    gt, ge, lt, le = bounds
    lo, hi = (gt if gt is not None else ge), (lt if lt is not None else le)
    if lo is None and hi is None and isinstance(value, float) and not math.isfinite(value):
        raise LmcliError(f"{flag_name(name)} must be a finite number, got {value}")
    bad = (
        (isinstance(value, float) and not math.isfinite(value))
        or (gt is not None and value <= gt)
        or (ge is not None and value < ge)
        or (lt is not None and value >= lt)
        or (le is not None and value > le)
    )
    if not bad:
        return
    name = flag_name(name)
    if hi is not None and lo is not None:
        left, right = "(" if gt is not None else "[", ")" if lt is not None else "]"
        raise LmcliError(f"{name} must be in {left}{_num(lo)}, {_num(hi)}{right}, got {value}")
    if gt == 0:
        raise LmcliError(f"{name} must be positive, got {value}")
    if lo is not None:
        raise LmcliError(f"{name} must be {'>' if gt is not None else '>='} {_num(lo)}, got {value}")
    raise LmcliError(f"{name} must be {'<' if lt is not None else '<='} {_num(hi)}, got {value}")


def is_section(tp: Any) -> bool:
    """Whether a field's type is a group of options (a ``Section``) rather than an option."""
    return isinstance(tp, type) and issubclass(tp, Section)


@functools.cache
def option_fields(cls: type) -> tuple[tuple[str | None, dataclasses.Field, Any], ...]:
    """Every option of a config, its sections' flattened in declaration order: (the section's
    attribute, or None for the config's own; the field; its type)."""
    hints = field_types(cls)
    out: list[tuple[str | None, dataclasses.Field, Any]] = []
    for f in fields(cls):
        if is_section(hints[f.name]):
            section = hints[f.name]
            out += [(f.name, g, field_types(section)[g.name]) for g in fields(section)]
        else:
            out.append((None, f, hints[f.name]))
    return tuple(out)


def check_fields(cfg: Any) -> None:
    """Parse, type-check and range-check every field of a config from its declaration (a
    section checks its own fields as it is built)."""
    hints = field_types(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_section(hints[f.name]):
            if not isinstance(value, hints[f.name]):
                raise LmcliError(f"{f.name} must be a {hints[f.name].__name__}, got {value!r}")
            continue
        parse = f.metadata.get("parse")
        if parse is not None and isinstance(value, str):
            value = parse(value)
        value = _coerce(f.name, value, hints[f.name])
        if value is not None and "range" in f.metadata and not isinstance(value, str | tuple | bool):
            _check_range(f.name, value, f.metadata["range"])
        if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
            raise LmcliError(f"{flag_name(f.name)} must be below 2**63 in size (64 bits), got {value}")
        object.__setattr__(cfg, f.name, value)


DEVICE_HELP = "Device to run on (auto: cuda, then mps, then cpu)."


THREADS_MAX = 4096  # a bound for the range check; lmcli.device.set_threads holds it to the machine's CPUs


def threads_option() -> Any:
    """``--threads``, one declaration for the configs that hold it (TrainConfig, DeviceConfig)."""
    return option(
        None,
        "CPU threads torch computes with. On a machine shared with other jobs, give each job only "
        "the cores it may keep busy (docs/quantization.md).",
        gt=0,
        le=THREADS_MAX,
        default_help="$OMP_NUM_THREADS if set, else the CPUs this process may use (affinity, cgroup "
        "quota); serve: one fewer",
        stored=False,  # a property of this machine: a resume elsewhere uses its own
    )


@dataclass(frozen=True)
class Section:
    """A group of options inside a config (``TrainConfig.optim``, ...). Its fields are options as
    any other: flags, ``config.json`` and messages name them flat (``--lr``, ``"lr"``); a TOML
    file may hold them under the section's table (``[optim]``); ``--help`` lists them under
    ``TITLE``. Checks between fields of different sections are the owning config's."""

    TITLE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self)
