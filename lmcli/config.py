"""Frozen configuration dataclasses: the one place where every option is declared.

Each field carries its type (``Literal`` for choices), default, help text and range in its
declaration, made with ``option(...)``. From those declarations ``lmcli.options`` derives the
command-line flags, TOML config files are checked against them, the generic checks below
validate them, and the resolved configs travel as JSON inside every checkpoint. Adding an option
is one new field.

``TrainConfig`` groups its options in sections (``Section`` subclasses: ``cfg.optim.lr``,
``cfg.schedule.max_steps``, ...). Outside the code every option keeps one flat name: its flag,
its TOML key, its key in ``config.json`` and in messages; ``to_dict``/``from_dict`` convert
between the flat options and the sections, ``replace_options`` replaces options by flat name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

from lmcli.errors import LmcliError
from lmcli.tasks import make_task

Position = Literal["learned", "sinusoidal", "rope", "alibi"]
Mlp = Literal["gelu", "relu", "relu2", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
NormPlacement = Literal["pre", "post"]
Task = Literal["lm", "translation", "sft"]
Device = Literal["auto", "cpu", "cuda", "mps"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
RopeScaling = Literal["none", "linear", "llama3", "yarn"]
ExportFormat = Literal["hf", "gguf", "lmcli"]
GgufType = Literal["f32", "f16", "q8_0", "q4_0"]
Quantize = Literal["none", "int8", "int4"]
GROUP_SIZES = (32, 64, 128, 256)  # the int4 kernels' group sizes
LORA_TARGETS = ("qkv", "attn_out", "fc", "gate", "mlp_out")  # lmcli.lora.TARGETS: the layers they name
Optimizer = Literal["auto", "adamw", "muon"]
Schedule = Literal["auto", "cosine", "wsd", "linear"]
SELECT_METRICS = ("val_loss", "val_bleu", "val_chrf")  # --select: these, or task:NAME:METRIC
TASK_SCORES = ("acc", "acc_norm", "exact_match")  # an --eval-task's scores --select may follow
Parallel = Literal["auto", "ddp", "fsdp"]
Recompute = Literal["none", "full", "selective"]
TOKENIZER_KINDS = ("char", "byte", "bpe")
TRACKERS = ("tensorboard", "wandb")  # --log-to: lmcli.train.tracking's backends beside metrics.jsonl
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
    resume: Literal["fixed", "free", "derived"] = "fixed",
    stored: bool = True,
    absent: Any = None,
) -> Any:
    """A config field with everything the CLI, the checks and resume need to know about it.

    ``gt/ge/lt/le``: the allowed range (None allowed when the default is None). ``flag``: the
    flag's spelling when not ``--field-name`` (``--a/--b`` for a boolean's on/off pair);
    ``short``: a one-letter alias. ``default_help``: how help shows the default when the value
    itself says little. ``argument``: a positional argument. ``cli=False``: not a flag at all.
    ``parse``: converts text (a flag's or a TOML string) to the field's type. ``path``: a local
    path, stored absolute so the run works from any folder. ``resume``: for model fields,
    whether ``--resume`` may change it (``free``), must keep it (``fixed``), or neither because
    the data sets it (``derived``). ``stored=False``: a run folder's stored value is never
    used (resume, eval): a path lmcli writes to comes from this machine's flags or defaults,
    not from a run folder someone shared. ``absent``: the value a run folder written before
    the option existed had in effect (when it differs from today's default).
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


# ----------------------------------------------------------------------------- generic checks


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


# ----------------------------------------------------------------------------- the configs


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only Transformer. Travels inside every checkpoint."""

    TITLE: ClassVar[str] = "Model"  # the heading of its flags in `lmcli train --help`

    vocab_size: int = option(0, "Vocabulary size (from the tokenizer).", ge=0, cli=False, resume="derived")
    block_size: int = option(128, "Context length in tokens.", gt=0)
    n_layer: int = option(4, "Transformer blocks.", gt=0)
    n_head: int = option(4, "Attention heads.", gt=0)
    n_embd: int = option(128, "Embedding width.", gt=0)
    d_ff: int = option(0, "MLP width.", ge=0, default_help="4*n-embd, ~8/3*n-embd for swiglu")
    dropout: float = option(0.0, "Dropout rate.", ge=0, lt=1, resume="free")
    bias: bool = option(True, "Biases in linear layers and LayerNorm.", flag="--bias/--no-bias")
    position: Position = option("learned", "Position encoding.")
    mlp: Mlp = option("gelu", "Feed-forward network.")
    norm: Norm = option("layernorm", "Normalization.")
    norm_placement: NormPlacement = option("pre", "Norm before (pre) or after (post) each sublayer.")
    tie_embeddings: bool = option(
        True, "Share input and output embeddings.", flag="--tie-embeddings/--untie-embeddings"
    )
    norm_eps: float = option(1e-5, "Epsilon of the norms.", gt=0)
    rope_base: float = option(10000.0, "Base of the rotary position frequencies (rope_theta).", gt=0)
    rope_scaling: RopeScaling = option(
        "none", "Rotary frequency scaling for long contexts: linear, llama3 (Llama 3.x) or yarn (Qwen2.5)."
    )
    rope_factor: float = option(1.0, "Rope scaling: how many times the original context.", gt=0)
    rope_original_context: int = option(
        0, "Rope scaling (llama3, yarn): the context the model was pretrained with.", ge=0
    )
    rope_low_freq_factor: float = option(1.0, "Rope scaling llama3: low-frequency factor.", gt=0)
    rope_high_freq_factor: float = option(4.0, "Rope scaling llama3: high-frequency factor.", gt=0)
    n_kv_head: int = option(
        0, "Key/value heads (grouped-query attention); must divide n-head.", ge=0, default_help="n-head"
    )
    qkv_bias: bool = option(
        False, "Query/key/value biases even with --no-bias (Qwen2).", flag="--qkv-bias/--no-qkv-bias"
    )
    qk_norm: bool = option(
        False,
        "RMS-normalize each head's queries and keys before attention (QK-norm).",
        flag="--qk-norm/--no-qk-norm",
    )
    logit_softcap: float = option(
        0.0, "Cap the logits softly: cap * tanh(logits / cap) (0: off; Gemma 2 uses 30).", ge=0
    )
    zero_init: bool = option(
        False,
        "Start every residual output projection at zero (each block begins as the identity).",
        flag="--zero-init/--no-zero-init",
        resume="free",
    )
    vocab_multiple: int = option(
        0,
        "Round the embedding table and vocabulary projection up to a multiple of this many rows "
        "(fast GPU matmuls); outputs and exports keep the tokenizer's vocabulary. auto or 0: "
        "decided where the run trains.",
        ge=0,
        le=VOCAB_MULTIPLE_MAX,
        parse=parse_vocab_multiple,
        default_help="auto: 64 when training on CUDA, 1 elsewhere",
        absent=1,  # run folders written before the option: no padding
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.n_embd % self.n_head != 0:
            raise LmcliError(f"n-embd ({self.n_embd}) must be divisible by n-head ({self.n_head})")
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise LmcliError(f"rope needs an even head size, got n-embd/n-head = {self.head_dim}")
        if self.n_kv_head == 0:  # the default: one key/value head per query head
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_head % self.n_kv_head != 0:
            raise LmcliError(f"n-kv-head ({self.n_kv_head}) must divide n-head ({self.n_head})")
        if self.rope_scaling in ("llama3", "yarn") and not self.rope_original_context:
            raise LmcliError(f"rope-scaling {self.rope_scaling} needs --rope-original-context")
        if self.rope_scaling != "none" and self.position != "rope":
            raise LmcliError(f"rope-scaling {self.rope_scaling} needs --position rope")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table and the vocabulary projection: ``vocab_size`` rounded up
        to ``vocab_multiple`` (0, auto not yet resolved by training: no padding). The rows past
        ``vocab_size`` are never an input, never scored and never exported."""
        multiple = max(self.vocab_multiple, 1)
        return -(-self.vocab_size // multiple) * multiple

    @property
    def attn_bias(self) -> bool:
        """Whether the query/key/value projection has biases (the output projection: ``bias``)."""
        return self.bias or self.qkv_bias

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP; SwiGLU keeps the parameter count of a 4x GELU MLP."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            return 8 * ((8 * self.n_embd // 3 + 7) // 8)
        return 4 * self.n_embd

    @classmethod
    def on_resume(cls, kind: Literal["fixed", "free", "derived"]) -> tuple[str, ...]:
        """The fields a resumed run must keep (``fixed``: all that define what the weights
        compute), may change (``free``), or takes from its data (``derived``)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("resume") == kind)


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


@dataclass(frozen=True)
class DataConfig(Section):
    """What the run trains and validates on, and how text becomes tokens."""

    TITLE: ClassVar[str] = "Data"

    corpus: tuple[str, ...] = option(
        (),
        "Text files, folders (recursive), globs, .gz/.zst files, JSONL/parquet files (a text "
        "column), or a folder of token shards (lmcli tokenize). None: a built-in corpus.",
        argument=True,
        path=True,
    )
    dataset: str | None = option(
        None, "Hugging Face dataset NAME[:CONFIG] (or a local data file), read in streaming mode.", path=True
    )
    text_column: str = option("text", "Dataset, JSONL or parquet column holding the text.")
    split: str = option("train", "Dataset split to train on.")
    val: str | None = option(None, "Validation corpus (file, folder or glob) instead of a split.", path=True)
    val_fraction: float = option(0.1, "Last fraction of the corpus kept for validation.", ge=0, lt=1)
    tokenizer: str = option(
        "char", "char, byte, bpe (trained on the corpus) or a tokenizer.json path.", path=True
    )
    vocab_size: int = option(8000, "Vocabulary size for bpe.", gt=0)
    cache_dir: str | None = option(
        None,
        "Token cache folder.",
        default_help="~/.cache/lmcli or $LMCLI_CACHE",
        path=True,
        stored=False,
    )
    align_documents: bool = option(
        False,
        "Start every training window at a document's start (the <eos> before it), as nanochat does.",
    )
    document_mask: bool = option(
        False,
        "Keep attention within each document of a window; positions restart at each document "
        "(FlexAttention on a GPU, a block mask on the CPU).",
    )


@dataclass(frozen=True)
class TranslationConfig(Section):
    """``--task translation``: the parallel text and how a source is read."""

    TITLE: ClassVar[str] = "Translation"

    source: str | None = option(None, "Translation: line-aligned source file (.gz allowed).", path=True)
    target: str | None = option(None, "Translation: line-aligned target file (.gz allowed).", path=True)
    source_field: str = option("source", "Translation: TSV/JSONL/dataset column or language of the source.")
    target_field: str = option("target", "Translation: column or language of the target.")
    val_source: str | None = option(None, "Translation: validation source file.", path=True)
    val_target: str | None = option(None, "Translation: validation target file.", path=True)
    prefix_lm: bool = option(False, "Translation: source tokens attend to each other both ways.")


@dataclass(frozen=True)
class LoRAConfig(Section):
    """Low-rank adapters on the ``--init-from`` model instead of training every weight."""

    TITLE: ClassVar[str] = "LoRA"

    lora_rank: int = option(
        0, "LoRA: rank of the adapters on the --init-from model (0: train every weight).", ge=0
    )
    lora_alpha: float = option(16.0, "LoRA: the adapters' update is scaled by alpha / rank.", gt=0)
    lora_dropout: float = option(0.0, "LoRA: dropout on the adapters' input.", ge=0, lt=1)
    lora_targets: str = option(
        "qkv,attn_out,fc,mlp_out",
        "LoRA: the projections to adapt, comma-separated: qkv, attn_out, fc, gate (swiglu), mlp_out.",
    )
    lora_train_embeddings: bool = option(False, "LoRA: also train the token embedding and the output head.")


@dataclass(frozen=True)
class OptimConfig(Section):
    """The batch, the loss and the optimizer's step (the learning rate's course: ``schedule``)."""

    TITLE: ClassVar[str] = "Optimization"

    batch_size: int = option(8, "Sequences per micro-batch.", gt=0)
    grad_accum: int = option(1, "Micro-batches per optimizer step.", gt=0)
    optimizer: Optimizer = option(
        "auto",
        "muon: Muon for the blocks' weight matrices, AdamW (--lr) for the rest; adamw; "
        "auto: muon for a language model from scratch, else adamw.",
        absent="adamw",
    )
    lr: float = option(1e-3, "Peak learning rate (AdamW).", gt=0)
    muon_lr: float = option(0.02, "Muon: peak learning rate of the blocks' weight matrices.", gt=0)
    muon_momentum: float = option(0.95, "Muon: momentum (Nesterov).", ge=0, lt=1)
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only).", ge=0)
    beta1: float = option(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = option(0.95, "AdamW beta2.", ge=0, lt=1)
    grad_clip: float = option(1.0, "Clip the gradient norm to this (0: off).", ge=0)
    label_smoothing: float = option(0.0, "Label smoothing of the training loss.", ge=0, lt=1)
    ema: float = option(
        0.0,
        "Keep an exponential moving average of the weights with this decay, saved as ema/ (0: off).",
        ge=0,
        lt=1,
    )


@dataclass(frozen=True)
class ScheduleConfig(Section):
    """How long the run trains and the learning rate's course over it."""

    TITLE: ClassVar[str] = "Schedule"
    DEFAULT_STEPS: ClassVar[int] = 800  # used when no stop condition is given

    max_steps: int | None = option(
        None, "Stop after this many steps.", gt=0, default_help="800 if no other limit"
    )
    epochs: float | None = option(None, "Stop after this many passes over the corpus.", gt=0)
    max_time: float | None = option(
        None, "Stop (with a checkpoint) after this long: 90s, 30m, 2h.", gt=0, parse=parse_duration
    )
    schedule: Schedule = option(
        "auto",
        "Learning rate after warmup: wsd (warmup-stable-decay), cosine or linear decay; "
        "auto: wsd for a language model from scratch, else cosine.",
        absent="cosine",
    )
    warmup_steps: int = option(100, "Linear warmup steps.", ge=0)
    min_lr_ratio: float = option(0.1, "Floor of the decay as a fraction of the peak.", ge=0, le=1)
    decay_fraction: float = option(
        0.2, "wsd: the last fraction of the run (steps or --max-time) over which the rate decays.", gt=0, le=1
    )

    @property
    def stop_steps(self) -> int | None:
        """Step limit; the default applies only when neither epochs nor max-time is given."""
        if self.max_steps is None and self.epochs is None and self.max_time is None:
            return self.DEFAULT_STEPS
        return self.max_steps


@dataclass(frozen=True)
class ValidationConfig(Section):
    """When the run validates, on how much, and the metric ``best/`` follows."""

    TITLE: ClassVar[str] = "Validation"

    eval_interval: int = option(250, "Validate every N steps.", gt=0)
    eval_batches: int = option(20, "Validation batches per evaluation.", gt=0)
    select: str | None = option(
        None,
        "The validation metric best/ follows: val_loss, val_bleu, val_chrf, or task:NAME:METRIC "
        "(acc, acc_norm or exact_match of the --eval-task NAME).",
        default_help="val_bleu for translation with --bleu-samples, else val_loss",
        parse=parse_select,
    )
    bleu_samples: int = option(200, "Translation: validation pairs decoded greedily for BLEU (0: off).", ge=0)
    bleu_interval: int = option(
        0, "Translation: BLEU every N steps.", ge=0, default_help="at every validation"
    )
    eval_task: tuple[str, ...] = option(
        (),
        "A downstream task file (JSONL: multiple choice, cloze or generation; docs/evaluation.md) "
        "scored at every validation, as task:NAME:METRIC in metrics.jsonl (repeatable).",
        path=True,
    )
    eval_task_limit: int = option(
        100, "Rows of each --eval-task scored at every validation (the first N).", gt=0
    )


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Which checkpoints the run folder keeps, and when they are written."""

    TITLE: ClassVar[str] = "Checkpoints"

    save_interval: int = option(0, "Checkpoint every N steps.", ge=0, default_help="at every validation")
    keep_last: int = option(0, "Periodic step-N checkpoints to keep besides last and best.", ge=0)


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How the processes of a ``torchrun`` job share the model, and what is kept for the backward."""

    TITLE: ClassVar[str] = "Parallelism and memory"

    parallel: Parallel = option(
        "auto",
        "Under torchrun: ddp (a whole model per process), fsdp (parameters, gradients and "
        "optimizer state sharded across the processes, FSDP2; sharded checkpoints); auto: fsdp "
        "when the pre-flight finds that the model and its optimizer state do not fit one device.",
        stored=False,  # how this session is launched: a resume chooses again (any world size)
    )
    activation_checkpointing: Recompute = option(
        "none",
        "Recompute activations in the backward instead of keeping them, per block: full (keep "
        "each block's input only), selective (keep matmul and attention outputs, recompute the "
        "cheap elementwise ops and norms), none.",
    )


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a training run except the model's shape: the run's own options, then
    its sections (``cfg.optim.lr``, ``cfg.schedule.max_steps``, ...). Flags, TOML keys and the
    stored ``config.json`` name every option flat (``to_dict``, ``from_dict``)."""

    out: str | None = option(
        None, "Run folder.", short="-o", default_help="checkpoints/run-<time>", stored=False
    )
    task: Task = option(
        "lm",
        "lm (language modelling), translation (source <sep> target) or sft (prompt/response or "
        "chat rows; the loss on the replies only).",
    )
    init_from: str | None = option(
        None,
        "Start from a local Hugging Face folder (GPT-2, Llama, Qwen2, Mistral) or an lmcli run: "
        "fine-tuning, with its tokenizer and chat template.",
        path=True,
    )
    seed: int = option(1337, "Random seed (weights, data order, dropout).", ge=0, le=SEED_MAX)
    log_interval: int = option(10, "Log metrics every N steps.", gt=0)
    log_to: str = option(
        "",
        "Also log to: tensorboard, wandb (comma-separated; metrics.jsonl is always written).",
        default_help="metrics.jsonl only",
    )
    device: Device = option("auto", DEVICE_HELP)
    dtype: Dtype = option("auto", "Autocast dtype (auto: bf16 on CUDA, float32 elsewhere).")
    threads: int | None = threads_option()
    compile: bool = option(False, "torch.compile the model.")
    deterministic: bool = option(
        False, "Use torch's deterministic algorithms (ops that have none warn); slower on a GPU."
    )
    peak_tflops: float | None = option(
        None,
        "The device's peak TFLOP/s that MFU is reported against.",
        gt=0,
        default_help="a GPU's datasheet bf16 figure; on a CPU a float32 matmul rate measured at start",
        stored=False,  # a property of this machine: a resume elsewhere uses its own device's
    )
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    translation: TranslationConfig = dataclasses.field(default_factory=TranslationConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    parallelism: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        make_task(self).check()  # options this task cannot use (tasks.Task.check)
        self._check_data()
        lora = self.lora
        if lora.lora_rank:
            if not self.init_from:
                raise LmcliError("--lora-rank needs --init-from: the base model the adapters adapt")
            targets = [t.strip() for t in lora.lora_targets.split(",") if t.strip()]
            for name in targets or [""]:
                if name not in LORA_TARGETS:
                    raise LmcliError(
                        f"lora-targets: {name!r} names no layer: choose from {', '.join(LORA_TARGETS)}"
                    )
            if self.optim.ema:
                raise LmcliError("--ema averages full weights: it cannot be combined with --lora-rank")
        if self.data.tokenizer == "bpe" and self.data.vocab_size < 300:
            raise LmcliError(f"vocab-size for bpe must be at least 300, got {self.data.vocab_size}")
        self._check_eval_tasks()
        for name in self.trackers:
            if name not in TRACKERS:
                raise LmcliError(f"invalid log-to {name!r}: choose from {', '.join(TRACKERS)}")

    def _check_eval_tasks(self) -> None:
        """``--eval-task`` files of distinct names; ``--select task:NAME:...`` names one of them."""
        names = [task_name(path) for path in self.validation.eval_task]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise LmcliError(f"--eval-task: two files are named {twice[0]}: rename one")
        select = self.validation.select or ""
        if select.startswith("task:") and select.split(":")[1] not in names:
            given = ", ".join(names) if names else "none"
            raise LmcliError(
                f"--select {select}: no --eval-task is named {select.split(':')[1]} (given: {given})"
            )

    @property
    def trackers(self) -> tuple[str, ...]:
        """The tracking backends ``--log-to`` names, besides metrics.jsonl."""
        return tuple(dict.fromkeys(n.strip().lower() for n in self.log_to.split(",") if n.strip()))

    def _check_data(self) -> None:
        """One source of training text and of validation text; a tokenizer lmcli knows."""
        data, pairs = self.data, self.translation
        if (pairs.source is None) != (pairs.target is None):
            raise LmcliError("give both --source and --target")
        if (pairs.val_source is None) != (pairs.val_target is None):
            raise LmcliError("give both --val-source and --val-target")
        if pairs.source and (data.corpus or data.dataset):
            raise LmcliError("give --source/--target, or a corpus, or --dataset: only one")
        if data.val is None and pairs.val_source is None and data.val_fraction == 0.0:
            raise LmcliError("no validation data: give --val PATH or a --val-fraction above 0")
        if (data.align_documents or data.document_mask) and make_task(self).examples is not None:
            raise LmcliError(
                "--align-documents and --document-mask apply to a token stream (--task lm): "
                f"--task {self.task} trains on whole examples"
            )
        tokenizer = data.tokenizer
        if tokenizer not in TOKENIZER_KINDS and not (
            tokenizer.endswith(".json") or "/" in tokenizer or Path(tokenizer).exists()
        ):
            raise LmcliError(
                f"invalid tokenizer {tokenizer!r}: choose char, byte, bpe or a tokenizer.json path"
            )

    @property
    def optimizer_kind(self) -> str:
        """The optimizer: ``auto`` is the task's (``tasks.Task.default_optimizer``: Muon for a
        language model trained from scratch, AdamW for fine-tuning, translation and SFT)."""
        chosen = self.optim.optimizer
        return chosen if chosen != "auto" else make_task(self).default_optimizer()

    @property
    def schedule_kind(self) -> str:
        """The schedule: ``auto`` is the task's (wsd with Muon from scratch, cosine elsewhere)."""
        chosen = self.schedule.schedule
        return chosen if chosen != "auto" else make_task(self).default_schedule()

    @property
    def selected_metric(self) -> str:
        """The validation metric ``best/`` follows (``--select``, else the task's)."""
        chosen = self.validation.select
        return chosen if chosen is not None else make_task(self).default_metric()


@dataclass(frozen=True)
class SampleConfig:
    """Settings of `lmcli sample`: how the next token is chosen and when generation stops."""

    max_new_tokens: int = option(200, "Tokens to generate.", ge=0)
    min_new_tokens: int = option(0, "No <eos> before this many tokens.", ge=0)
    temperature: float = option(0.8, "Softmax temperature; 0 = greedy.", ge=0)
    top_k: int = option(0, "Keep the k most likely tokens (0 = off).", ge=0)
    top_p: float = option(1.0, "Nucleus: smallest set with mass >= p.", gt=0, le=1)
    min_p: float = option(0.0, "Drop tokens below min-p x the top one.", ge=0, lt=1)
    repetition_penalty: float = option(1.0, "> 1 discourages tokens already present.", gt=0)
    num_samples: int = option(1, "Samples per prompt.", gt=0)
    seed: int = option(1337, "Same seed, same text.", ge=0, le=SEED_MAX)
    stop: tuple[str, ...] = option((), "Stop when this text appears (repeatable).")

    def __post_init__(self) -> None:
        check_fields(self)
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / 1e-39 overflow to inf: NaN draws
            raise LmcliError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature:g}"
            )


@dataclass(frozen=True)
class ConstraintConfig:
    """What the generated text must be (`lmcli sample`, `lmcli chat`): at most one of a JSON
    schema, a regular expression or a grammar (docs/structured-output.md)."""

    json_schema: str | None = option(None, "The text is JSON valid against this JSON schema file.")
    regex: str | None = option(None, "The text matches this regular expression.")
    grammar: str | None = option(None, "The text follows this Lark grammar file (llguidance's Lark).")

    def __post_init__(self) -> None:
        check_fields(self)
        given = [f"--{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name) is not None]
        if len(given) > 1:
            raise LmcliError(f"give one constraint at most: {' and '.join(given)} were given together")


@dataclass(frozen=True)
class DraftConfig:
    """Speculative decoding in `lmcli sample` and `lmcli chat`: a small model proposes tokens."""

    draft: str | None = option(
        None,
        "A draft model (run folder, Hugging Face folder or GGUF file) with the same tokenizer: "
        "it proposes tokens that the model checks several at a time; the same text, sooner.",
        path=True,
    )
    draft_tokens: int = option(4, "Tokens the draft proposes per step of the model.", gt=0, le=64)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class BeamConfig:
    """Settings of `lmcli beam` (scores follow Hugging Face: sum of log-probs / length^alpha)."""

    beam_size: int = option(5, "Beams per input.", ge=1)
    length_penalty: float = option(1.0, "alpha in score = logprob / length^alpha.", ge=-10, le=10)
    max_new_tokens: int = option(200, "New-token limit.", gt=0)
    max_len_a: float = option(0.0, "Limit new tokens to a * input_tokens + b (with --max-len-b).", ge=0)
    max_len_b: int = option(0, "See --max-len-a.", ge=0)
    min_new_tokens: int = option(0, "No <eos> before this many tokens.", ge=0)
    nbest: int = option(1, "Hypotheses to print per input.")
    no_repeat_ngram_size: int = option(0, "Never repeat an n-gram of this size (0 = off).", ge=0)
    early_stopping: bool = option(True, "Stop an input once beam-size hypotheses have ended.")
    batch_size: int = option(16, "Inputs decoded together.", gt=0)

    def __post_init__(self) -> None:
        check_fields(self)
        if not 1 <= self.nbest <= self.beam_size:
            raise LmcliError(f"nbest must be between 1 and beam-size ({self.beam_size}), got {self.nbest}")

    def max_new_for(self, input_len: int) -> int:
        """New-token limit for an input: a * input_len + b (fairseq), capped by max-new-tokens."""
        if self.max_len_a or self.max_len_b:
            return max(1, min(self.max_new_tokens, int(self.max_len_a * input_len + self.max_len_b)))
        return self.max_new_tokens


@dataclass(frozen=True)
class EvalConfig:
    """Settings of `lmcli eval`: what text to score (besides paths) and how."""

    dataset: str | None = option(None, "Hugging Face dataset NAME[:CONFIG] (or a local data file).")
    text_column: str = option("text", "Dataset column holding the text.")
    split: str = option("test", "Dataset split.")
    source: str | None = option(None, "Translation model: source file (with --target).")
    target: str | None = option(None, "Translation model: target file (with --source).")
    context: int | None = option(None, "Tokens per window.", gt=0, default_help="the model's block size")
    stride: int | None = option(
        None,
        "Tokens between window starts; below the context, windows overlap and each token is "
        "still scored once, with more left context.",
        ge=1,
        default_help="the context",
    )
    batch_size: int = option(8, "Windows (--task: questions) per forward pass.", gt=0)
    per_line: bool = option(False, "Score each line on its own as <bos> line <eos>.")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.context and self.stride and self.stride > self.context:
            raise LmcliError(f"stride must be between 1 and the context ({self.context}), got {self.stride}")


@dataclass(frozen=True)
class DownstreamConfig:
    """Settings of `lmcli eval --task/--harness`: downstream benchmarks (docs/evaluation.md), not
    the training tasks (``--task lm|translation|sft`` of `lmcli train`)."""

    task: tuple[str, ...] = option(
        (),
        "A task file (JSONL: multiple choice, cloze or generation rows, or the published HellaSwag, "
        "ARC, LAMBADA or GSM8K layout) to score (repeatable).",
    )
    harness: str | None = option(
        None,
        "lm-evaluation-harness tasks, comma-separated (hellaswag,arc_easy); needs lmcli[harness] "
        "and the tasks' datasets.",
    )
    include_path: str | None = option(None, "--harness: a folder of more lm-evaluation-harness task YAMLs.")
    limit: int | None = option(None, "Score at most the first N rows of each task.", gt=0)
    num_fewshot: int | None = option(
        None,
        "Solved examples before each question (--task: the file's fewshot rows).",
        ge=0,
        default_help="0; --harness: each task's own",
    )
    max_gen_tokens: int = option(256, "Generation tasks: most tokens generated per answer.", gt=0)

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def wanted(self) -> bool:
        """Whether any downstream task is asked for."""
        return bool(self.task or self.harness)


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how `eval`, `sample`, `beam`, `chat` and `serve` run the model."""

    device: Device = option("auto", DEVICE_HELP)
    dtype: Dtype = option(
        "auto",
        "Dtype of the weights (auto: as stored in the folder). On a GPU float32 weights compute "
        "under bf16 autocast (float16 without native bf16); float32: no autocast.",
    )
    threads: int | None = threads_option()
    quantize: Quantize = option(
        "none",
        "Weight-only quantization of the linear layers after loading: int8 (per output channel) "
        "or int4 (groups of --group-size; the vocabulary head stays int8). docs/quantization.md.",
    )
    group_size: int = option(64, "int4: weights per quantization group (32, 64, 128 or 256).")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.group_size not in GROUP_SIZES:
            raise LmcliError(
                f"group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}"
            )


@dataclass(frozen=True)
class ServeConfig:
    """Settings of `lmcli serve`: where it listens, who may call it, and its limits."""

    host: str = option("127.0.0.1", "Address to listen on (loopback by default).")
    port: int = option(8000, "Port to listen on (0: any free port).", ge=0, le=65535)
    api_key: str | None = option(
        None,
        "Require 'Authorization: Bearer KEY' on every endpoint but /health and the page.",
        default_help="$LMCLI_API_KEY, else none",
    )
    model_name: str | None = option(
        None, "Model id shown by /v1/models.", default_help="the run folder's name"
    )
    max_batch: int = option(32, "Sequences decoded together (rows of the batched KV cache).", gt=0)
    max_tokens: int = option(1024, "Most tokens one request may generate (per choice).", gt=0)
    max_queue: int = option(64, "Requests waiting for a row; beyond it: 503 with Retry-After.", ge=0)
    max_body: int = option(1 << 20, "Largest request body in bytes; beyond it: 413.", gt=0)
    timeout: float = option(
        300.0, "Per-request time limit (queue wait included): 90s, 5m.", gt=0, parse=parse_duration
    )
    max_connections: int = option(
        512, "Open connections at most (fewer if ulimit -n is lower); beyond: the idlest closes.", gt=0
    )
    client_timeout: float = option(
        10.0, "Seconds a client has to send a request's headers, then its body.", gt=0, parse=parse_duration
    )
    grace: float = option(
        10.0,
        "On SIGTERM/Ctrl-C: time to finish in-flight requests before cancelling them.",
        ge=0,
        parse=parse_duration,
    )
    cache_memory: int = option(
        256 << 20,
        "Memory of the prefix cache (keys/values of earlier prompts and replies, reused by "
        "requests that begin alike; least recently used evicted): 512MiB, 2GiB; 0: no cache.",
        ge=0,
        parse=parse_size,
        default_help="256MiB",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.host.strip():
            raise LmcliError("host must not be empty")
        if self.api_key is not None:  # "" or " " would disable the key, or make it unmatchable
            if not self.api_key.strip():
                raise LmcliError("api-key must not be empty or blank: give a key, or none")
            object.__setattr__(self, "api_key", self.api_key.strip())


@dataclass(frozen=True)
class ChatConfig:
    """Settings of `lmcli chat` besides its sampling options (those are `lmcli sample`'s)."""

    system: str | None = option(None, "System prompt: a system message before the conversation.")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ExportConfig:
    """Settings of `lmcli export`: the format and, for GGUF, the type of the weights."""

    format: ExportFormat = option(
        "hf",
        "hf: a Hugging Face folder; gguf: one GGUF file for llama.cpp; lmcli: a checkpoint folder.",
    )
    merge: bool = option(False, "Fold a LoRA run's adapters into its base's weights (a LoRA run needs it).")
    dtype: GgufType | None = option(
        None,
        "GGUF: type of the weight matrices (q8_0: 8-bit blocks; q4_0: 4-bit blocks, the vocabulary "
        "q8_0; norms and biases stay f32).",
        default_help="f16",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dtype is not None and self.format != "gguf":
            raise LmcliError("--dtype applies to --format gguf only")

    @property
    def gguf_type(self) -> str:
        return self.dtype or "f16"


@dataclass(frozen=True)
class AverageConfig:
    """Settings of `lmcli average`: which saved checkpoints to average."""

    last: int = option(5, "Average the N newest step-N checkpoints (saved with --keep-last).", gt=0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class TokenizeConfig:
    """Settings of `lmcli tokenize`: where the shards go and how they are made; what is read and
    how text becomes tokens are `lmcli train`'s data options (``data``)."""

    out: str | None = option(
        None, "Folder of token shards to write (or to finish, after an interruption).", short="-o", path=True
    )
    workers: int = option(0, "Processes that tokenize (0: one per core).", ge=0, default_help="one per core")
    shard_tokens: int = option(100_000_000, "Tokens per shard (about: a shard ends with a whole job).", gt=0)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.out:
            raise LmcliError("give --out DIR: the folder the token shards go to")


# ----------------------------------------------------------------------------- dicts and files


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
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LmcliError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(raw)
        else:
            import tomllib

            data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LmcliError(f"cannot parse config file {path}: {exc}") from None
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
