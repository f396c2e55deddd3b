"""The configs of the commands besides ``train``: sample, beam, eval, serve, chat, export, ..."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Literal

from lmcli.config.fields import (
    DEVICE_HELP,
    MIN_TEMPERATURE,
    SEED_MAX,
    Device,
    Dtype,
    check_fields,
    option,
    parse_duration,
    parse_size,
    threads_option,
)
from lmcli.config.train import DataConfig, DistillConfig
from lmcli.errors import LmcliError

ExportFormat = Literal["hf", "gguf", "lmcli"]


# llama-quantize's presets, as `export --dtype` and `--quantize` take them (any case: q4_k_m is
# Q4_K_M); lmcli's own four keep their lower-case names. Each one's types: formats/export/presets.py
GGUF_PRESETS = (
    *("f32", "f16", "q8_0", "q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L"),
    *("Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"),
)
QUANTIZE_MODES = ("none", "int8", "int4")  # --quantize besides the presets (int8: q8_0, int4: q4_0 blocks)


def parse_gguf_type(value: str) -> str:
    """A preset's name in any case, as ``GGUF_PRESETS`` spells it."""
    found = next((p for p in GGUF_PRESETS if p.upper() == value.strip().upper()), None)
    if found is None:
        raise LmcliError(f"invalid dtype {value!r}: choose one of {', '.join(GGUF_PRESETS)}")
    return found


def parse_quantize(value: str) -> str:
    """--quantize: none, int8, int4 or a preset (any case)."""
    if value.strip().lower() in QUANTIZE_MODES:
        return value.strip().lower()
    try:
        return parse_gguf_type(value)
    except LmcliError:
        listed = ", ".join((*QUANTIZE_MODES, *GGUF_PRESETS[2:]))
        raise LmcliError(f"invalid quantize {value!r}: choose one of {listed}") from None


TeacherLogits = Literal["top", "sampled"]  # lmcli tokenize --teacher: data.logit_shards.LAYOUTS
KvDtype = Literal["auto", "float32", "bfloat16", "float16", "q8_0", "q4_0"]


GROUP_SIZES = (32, 64, 128, 256)  # the int4 kernels' group sizes


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
    preferences: str | None = option(
        None,
        "Preference pairs (JSONL, as --task dpo reads them): the model's preference accuracy and "
        "mean margin in nats (docs/post-training.md).",
        path=True,
    )
    reference: str | None = option(
        None,
        "With --preferences: a reference model (its tokenizer the model's): the margin of the "
        "log-ratios to it, DPO's implicit reward.",
        path=True,
    )
    kl_divergence: str | None = option(
        None,
        "A reference model (the model's tokenizer; float32): what quantizing cost, as "
        "llama-perplexity --kl-divergence says it: KL(reference || model) per token (mean, median, "
        "99th percentile), top-1 agreement, perplexity ratio. docs/quantization.md.",
        path=True,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.reference and not self.preferences:
            raise LmcliError("--reference needs --preferences: the pairs to compare the models on")
        if self.kl_divergence and (self.preferences or self.per_line):
            raise LmcliError(
                "--kl-divergence compares the models on text: not with --preferences or --per-line"
            )
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
    quantize: str = option(
        "none",
        "Weight-only quantization of the linear layers after loading: int8 (per output channel), "
        "int4 (groups of --group-size; the vocabulary head stays int8), or a GGUF preset "
        "(q8_0, q4_0, Q4_K_M, ...: each matrix in llama-quantize's type, on a CPU). "
        "docs/quantization.md.",
        parse=parse_quantize,
    )
    group_size: int = option(64, "int4: weights per quantization group (32, 64, 128 or 256).")
    kv_dtype: KvDtype = option(
        "auto",
        "Dtype of the KV cache's keys and values (auto: the dtype the model computes in; float16 "
        "for GGUF blocks on lmcli's CPU kernels: a GGUF file, --quantize). "
        "bfloat16 or float16 halves its memory and the bytes attention reads; q8_0 (8.5 bits a "
        "value) or q4_0 (4.5) keep each head's row as llama.cpp's --cache-type-k/-v blocks of 32 "
        "(the head size a multiple of 32). Attention still computes in the model's dtype. "
        "docs/quantization.md.",
    )
    verbose: bool = option(
        False,
        "After loading, print on stderr one line naming the path the model's products take "
        "(lmcli's native kernels and their instruction set, or torch's).",
    )

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
    dtype: str | None = option(
        None,
        "GGUF: f32, f16, or a llama-quantize preset, any case (q8_0, q4_0, Q4_K_M, Q5_K_M, Q6_K, "
        "IQ4_XS, ...: each matrix in the type llama-quantize gives it; norms and biases stay f32). "
        "docs/quantization.md.",
        default_help="f16",
        parse=parse_gguf_type,
    )
    imatrix: str | None = option(
        None,
        "GGUF: an importance matrix (lmcli's or llama.cpp's, GGUF or .dat) for the quantized "
        "types, or a calibration text to compute one from on the way (`lmcli imatrix`).",
        path=True,
    )
    threads: int | None = threads_option()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dtype is not None and self.format != "gguf":
            raise LmcliError("--dtype applies to --format gguf only")
        if self.imatrix is not None and self.format != "gguf":
            raise LmcliError("--imatrix applies to --format gguf only")

    @property
    def gguf_type(self) -> str:
        return self.dtype or "f16"


@dataclass(frozen=True)
class ImatrixConfig:
    """Settings of `lmcli imatrix`: where the importance matrix goes and the windows it runs."""

    out: str = option(
        "imatrix.gguf", "The importance matrix file to write (GGUF, llama.cpp's layout).", path=True
    )
    context: int | None = option(None, "Tokens per window.", gt=0, default_help="the model's block size")
    batch_size: int = option(1, "Windows per forward pass.", gt=0)
    device: Device = option("auto", DEVICE_HELP)
    threads: int | None = threads_option()

    def __post_init__(self) -> None:
        check_fields(self)


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
    top_k: int = option(
        64,
        "With --teacher: keep K next tokens a position: its K most likely (their log-probs after "
        "the softmax over the whole vocabulary) and the mass left to the others, or K drawn from "
        "the teacher (--logits sampled).",
        gt=0,
    )
    logits: TeacherLogits = option(
        "top",
        "With --teacher: top (each position's K most likely tokens and the mass left: the loss on "
        "them a lower bound) or sampled (K tokens drawn from the teacher's distribution: an unbiased "
        "estimate of the forward KL, the only loss they train; docs/distillation.md).",
    )
    block_size: int = option(
        128,
        "With --teacher: it reads the corpus in chunks of this many tokens (train the student with "
        "this --block-size: its windows then see what the teacher saw).",
        gt=0,
    )
    batch_size: int = option(8, "With --teacher: chunks it reads at once.", gt=0)
    device: Device = option("auto", "With --teacher: the device it runs on (auto: cuda, then mps, then cpu).")
    threads: int | None = threads_option()
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.out:
            raise LmcliError("give --out DIR: the folder the token shards go to")
        defaults = {f.name: f.default for f in fields(self)}
        if not self.distill.teacher:
            for name in ("top_k", "logits", "block_size", "batch_size", "device"):
                if getattr(self, name) != defaults[name]:
                    raise LmcliError(f"--{name.replace('_', '-')} needs --teacher")
            if self.distill.distill_temperature != DistillConfig().distill_temperature:
                raise LmcliError("--distill-temperature needs --teacher")
        elif self.data.tokenizer != DataConfig().tokenizer:
            raise LmcliError(
                "--tokenizer: with --teacher the corpus is tokenized with the teacher's tokenizer: drop it"
            )
