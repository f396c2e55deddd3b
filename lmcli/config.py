"""Frozen configuration dataclasses: the single source of option defaults.

The CLI reads its defaults from these classes, TOML files are checked against their fields, and
the resolved configs are stored as JSON inside every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from lmcli.errors import LmcliError

POSITIONS = ("learned", "sinusoidal", "rope", "alibi")
MLPS = ("gelu", "relu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
TOKENIZER_KINDS = ("char", "byte", "bpe")
TASKS = ("lm", "translation")
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")

C = TypeVar("C")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LmcliError(f"invalid {name} {value!r}: choose one of {', '.join(allowed)}")


def _positive(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise LmcliError(f"{name} must be positive, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0 or not math.isfinite(value):
        raise LmcliError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only Transformer. Travels inside every checkpoint."""

    vocab_size: int = 0  # 0 = take it from the tokenizer
    block_size: int = 128  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    d_ff: int = 0  # feed-forward width; 0 = 4*n_embd (gelu/relu) or ~8/3*n_embd (swiglu)
    dropout: float = 0.0
    bias: bool = True
    position: str = "learned"
    mlp: str = "gelu"
    norm: str = "layernorm"
    norm_placement: str = "pre"
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            _positive(name.replace("_", "-"), getattr(self, name))
        _non_negative("vocab-size", self.vocab_size)
        _non_negative("d-ff", self.d_ff)
        if not 0.0 <= self.dropout < 1.0:
            raise LmcliError(f"dropout must be in [0, 1), got {self.dropout}")
        _choice("position", self.position, POSITIONS)
        _choice("mlp", self.mlp, MLPS)
        _choice("norm", self.norm, NORMS)
        _choice("norm-placement", self.norm_placement, NORM_PLACEMENTS)
        if self.n_embd % self.n_head != 0:
            raise LmcliError(f"n-embd ({self.n_embd}) must be divisible by n-head ({self.n_head})")
        if self.position == "rope" and self.head_dim % 2 != 0:
            raise LmcliError(f"rope needs an even head size, got n-embd/n-head = {self.head_dim}")
        _positive("norm-eps", self.norm_eps)
        _positive("rope-base", self.rope_base)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP; SwiGLU keeps the parameter count of a 4x GELU MLP."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            return 8 * ((8 * self.n_embd // 3 + 7) // 8)
        return 4 * self.n_embd


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a training run except the model's shape."""

    task: str = "lm"  # lm | translation
    corpus: tuple[str, ...] = ()  # files, folders, globs, .gz; empty = built-in corpus
    source: str | None = None  # translation: line-aligned source file
    target: str | None = None  # translation: line-aligned target file
    source_field: str = "source"  # translation: TSV/JSONL/dataset column, or language key
    target_field: str = "target"
    val_source: str | None = None  # translation: validation source file
    val_target: str | None = None
    prefix_lm: bool = False  # translation: source positions attend to each other both ways
    dataset: str | None = None  # Hugging Face datasets name, NAME[:CONFIG]
    text_column: str = "text"
    split: str = "train"
    val: str | None = None  # a validation corpus (path or glob); otherwise --val-fraction
    val_fraction: float = 0.1
    tokenizer: str = "char"  # char | byte | bpe | path/to/tokenizer.json
    vocab_size: int = 8000  # for --tokenizer bpe
    out: str | None = None  # run folder; default checkpoints/run-<time>
    cache_dir: str | None = None  # tokenized-corpus cache; default ~/.cache/lmcli
    init_from: str | None = None  # a local Hugging Face GPT-2 folder to fine-tune
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int | None = None  # DEFAULT_STEPS when no other limit is given
    epochs: float | None = None
    max_time: float | None = None  # seconds
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    label_smoothing: float = 0.0  # training loss only; validation loss is plain NLL
    eval_interval: int = 250
    eval_batches: int = 20
    bleu_samples: int = 200  # translation: validation pairs decoded greedily for BLEU (0 = off)
    bleu_interval: int = 0  # translation: BLEU every N steps; 0 = at every validation
    save_interval: int = 0  # 0 = at every evaluation
    keep_last: int = 0  # periodic step-N checkpoints to keep besides last/best
    log_interval: int = 10
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False

    DEFAULT_STEPS = 800  # not a field: used when no stop condition is given

    def __post_init__(self) -> None:
        object.__setattr__(self, "corpus", tuple(str(c) for c in self.corpus))
        _choice("task", self.task, TASKS)
        if self.task == "lm" and (self.source or self.target or self.val_source or self.prefix_lm):
            raise LmcliError("--source, --target, --val-source and --prefix-lm need --task translation")
        if (self.source is None) != (self.target is None):
            raise LmcliError("give both --source and --target")
        if (self.val_source is None) != (self.val_target is None):
            raise LmcliError("give both --val-source and --val-target")
        if self.source and (self.corpus or self.dataset):
            raise LmcliError("give --source/--target, or a corpus, or --dataset: only one")
        if not 0.0 <= self.val_fraction < 1.0:
            raise LmcliError(f"val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.val is None and self.val_source is None and self.val_fraction == 0.0:
            raise LmcliError("no validation data: give --val PATH or a --val-fraction above 0")
        _positive("vocab-size", self.vocab_size)
        if self.tokenizer not in TOKENIZER_KINDS and not (
            self.tokenizer.endswith(".json") or "/" in self.tokenizer or Path(self.tokenizer).exists()
        ):
            raise LmcliError(
                f"invalid tokenizer {self.tokenizer!r}: choose char, byte, bpe or a tokenizer.json path"
            )
        if self.tokenizer == "bpe" and self.vocab_size < 300:
            raise LmcliError(f"vocab-size for bpe must be at least 300, got {self.vocab_size}")
        for name in ("batch_size", "grad_accum", "eval_interval", "eval_batches", "log_interval"):
            _positive(name.replace("_", "-"), getattr(self, name))
        _positive("max-steps", self.max_steps, allow_none=True)
        _positive("epochs", self.epochs, allow_none=True)
        _positive("max-time", self.max_time, allow_none=True)
        _positive("lr", self.lr)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise LmcliError(f"min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise LmcliError(f"label-smoothing must be in [0, 1), got {self.label_smoothing}")
        for name in (
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "save_interval",
            "keep_last",
            "bleu_samples",
            "bleu_interval",
        ):
            _non_negative(name.replace("_", "-"), getattr(self, name))
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise LmcliError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)

    @property
    def stop_steps(self) -> int | None:
        """Step limit; the default applies only when neither epochs nor max-time is given."""
        if self.max_steps is None and self.epochs is None and self.max_time is None:
            return self.DEFAULT_STEPS
        return self.max_steps


def parse_duration(value: str | float | int) -> float:
    """Seconds from 5400, '90s', '30m', '2h' or '1h30m'."""
    if isinstance(value, int | float):
        return float(value)
    text = value.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise LmcliError(f"invalid duration {value!r}: use e.g. 90s, 30m, 2h or 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass."""
    out = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def from_dict(cls: type[C], data: dict[str, Any], *, source: str = "config") -> C:
    """Build ``cls`` from a dict, with a one-line error for unknown keys or wrong types."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise LmcliError(f"{source}: unknown option(s) {', '.join(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise LmcliError(f"{source}: {exc}") from None


def field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def default_of(cls: type, name: str) -> Any:
    """The default value of a dataclass field (used for CLI help so it never drifts)."""
    for f in fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (or JSON) config file into a flat ``{option: value}`` dict.

    Keys may use dashes or underscores and may sit at the top level or under ``[model]`` /
    ``[train]`` tables.
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
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("model", "train"):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
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


@dataclass(frozen=True)
class SampleConfig:
    """Settings of `lmcli sample`: how the next token is chosen and when generation stops."""

    max_new_tokens: int = 200
    min_new_tokens: int = 0  # no <eos> before this many new tokens
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus: smallest set with probability mass >= top_p
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the text
    num_samples: int = 1
    seed: int = 1337
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        _non_negative("max-new-tokens", self.max_new_tokens)
        _non_negative("min-new-tokens", self.min_new_tokens)
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise LmcliError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LmcliError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LmcliError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise LmcliError(f"min-p must be in [0, 1), got {self.min_p}")
        _positive("repetition-penalty", self.repetition_penalty)
        _positive("num-samples", self.num_samples)


@dataclass(frozen=True)
class BeamConfig:
    """Settings of `lmcli beam` (scores follow Hugging Face: sum of log-probs / length^alpha)."""

    beam_size: int = 5
    length_penalty: float = 1.0  # alpha
    max_new_tokens: int = 200
    max_len_a: float = 0.0  # with max-len-b: at most a * input_tokens + b new tokens
    max_len_b: int = 0
    min_new_tokens: int = 0
    nbest: int = 1
    no_repeat_ngram_size: int = 0
    early_stopping: bool = True  # stop an input once beam-size hypotheses have ended
    batch_size: int = 16  # inputs decoded together

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise LmcliError(f"beam-size must be >= 1, got {self.beam_size}")
        if not 1 <= self.nbest <= self.beam_size:
            raise LmcliError(f"nbest must be between 1 and beam-size ({self.beam_size}), got {self.nbest}")
        _positive("max-new-tokens", self.max_new_tokens)
        _non_negative("max-len-a", self.max_len_a)
        _non_negative("max-len-b", self.max_len_b)
        _non_negative("min-new-tokens", self.min_new_tokens)
        _non_negative("no-repeat-ngram-size", self.no_repeat_ngram_size)
        _positive("batch-size", self.batch_size)

    def max_new_for(self, input_len: int) -> int:
        """New-token limit for an input: a * input_len + b (fairseq), capped by max-new-tokens."""
        if self.max_len_a or self.max_len_b:
            return max(1, min(self.max_new_tokens, int(self.max_len_a * input_len + self.max_len_b)))
        return self.max_new_tokens


@dataclass(frozen=True)
class EvalConfig:
    """Settings of `lmcli eval`."""

    context: int | None = None  # tokens per window; None = the model's block size
    stride: int | None = None  # tokens between window starts; None = the context (plain blocks)
    batch_size: int = 8
    per_line: bool = False

    def __post_init__(self) -> None:
        _positive("context", self.context, allow_none=True)
        if self.stride is not None and self.stride < 1:
            raise LmcliError(f"stride must be >= 1, got {self.stride}")
        if self.context and self.stride and self.stride > self.context:
            raise LmcliError(f"stride must be between 1 and the context ({self.context}), got {self.stride}")
        _positive("batch-size", self.batch_size)
