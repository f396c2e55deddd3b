"""``TrainConfig`` and its sections (data, optimizer, schedule, validation, checkpoints, ...)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from lmcli.config.fields import (
    DEVICE_HELP,
    SEED_MAX,
    Device,
    Dtype,
    Section,
    check_fields,
    option,
    option_fields,
    parse_duration,
    parse_select,
    task_name,
    threads_option,
)
from lmcli.errors import LmcliError
from lmcli.tasks import make_task

LORA_TARGETS = ("qkv", "attn_out", "fc", "gate", "mlp_out")  # lmcli.model.lora.TARGETS: the layers they name


Optimizer = Literal["auto", "adamw", "muon"]


Schedule = Literal["auto", "cosine", "wsd", "linear"]


Parallel = Literal["auto", "ddp", "fsdp"]


Recompute = Literal["none", "full", "selective"]


TOKENIZER_KINDS = ("char", "byte", "bpe")


TRACKERS = ("tensorboard", "wandb")  # --log-to: lmcli.train.tracking's backends beside metrics.jsonl


Task = Literal["lm", "translation", "sft", "dpo", "grpo", "distill"]


PreferenceLoss = Literal["dpo", "ipo", "simpo"]


DistillLoss = Literal["forward_kl", "reverse_kl", "jsd"]


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
        resume="data",
    )
    dataset: str | None = option(
        None,
        "Hugging Face dataset NAME[:CONFIG] (or a local data file), read in streaming mode.",
        path=True,
        resume="data",
    )
    text_column: str = option("text", "Dataset, JSONL or parquet column holding the text.", resume="data")
    split: str = option("train", "Dataset split to train on.", resume="data")
    val: str | None = option(
        None, "Validation corpus (file, folder or glob) instead of a split.", path=True, resume="data"
    )
    val_fraction: float = option(
        0.1, "Last fraction of the corpus kept for validation.", ge=0, lt=1, resume="data"
    )
    tokenizer: str = option(
        "char",
        "char, byte, bpe (trained on the corpus) or a tokenizer.json path.",
        path=True,
        resume="fixed",
    )
    vocab_size: int = option(8000, "Vocabulary size for bpe.", gt=0, resume="fixed")
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

    source: str | None = option(
        None, "Translation: line-aligned source file (.gz allowed).", path=True, resume="data"
    )
    target: str | None = option(
        None, "Translation: line-aligned target file (.gz allowed).", path=True, resume="data"
    )
    source_field: str = option(
        "source", "Translation: TSV/JSONL/dataset column or language of the source.", resume="data"
    )
    target_field: str = option("target", "Translation: column or language of the target.", resume="data")
    val_source: str | None = option(None, "Translation: validation source file.", path=True, resume="data")
    val_target: str | None = option(None, "Translation: validation target file.", path=True, resume="data")
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
        "The validation metric best/ follows: val_loss, val_bleu, val_chrf (translation), "
        "val_accuracy, val_margin (dpo), val_reward, val_pass@1 (grpo), or task:NAME:METRIC "
        "(acc, acc_norm or exact_match of the --eval-task NAME).",
        default_help="val_bleu for translation with --bleu-samples, val_reward for grpo, else val_loss",
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
class PostTrainConfig(Section):
    """``--task dpo`` (preference pairs) and ``--task grpo`` (prompts and verifiable rewards):
    docs/post-training.md."""

    TITLE: ClassVar[str] = "Post-training"

    beta: float = option(
        0.1,
        "DPO/IPO: how far the model may move from the reference (smaller: further); "
        "SimPO: the reward scale (about 2).",
        gt=0,
    )
    preference_loss: PreferenceLoss = option(
        "dpo",
        "DPO: dpo (sigmoid), ipo (squared, bounded margin) or simpo (reference-free, length-normalized).",
    )
    simpo_gamma: float = option(0.5, "SimPO: the target reward margin.", ge=0)
    precompute_reference: bool = option(
        False,
        "DPO with full fine-tuning: compute the reference's log-probs of every pair once before "
        "training instead of keeping a frozen copy of the model in memory.",
    )
    reward: tuple[str, ...] = option(
        (),
        "GRPO: a reward (repeatable, summed): number, exact, regex:PATTERN, json, "
        "json_schema[:FILE], length:N, or path/to/file.py:function.",
    )
    group_size: int = option(8, "GRPO: replies sampled per prompt (their rewards are compared).", ge=2)
    kl_coef: float = option(
        0.0, "GRPO: weight of the KL term to the reference (0: none, and no reference is kept).", ge=0
    )
    ratio_clip: float = option(0.2, "GRPO: the clip range of the policy ratio (PPO's epsilon).", gt=0, lt=1)
    grpo_steps: int = option(1, "GRPO: optimizer steps on each batch of sampled replies.", gt=0)
    max_new_tokens: int = option(128, "GRPO: the longest reply sampled (tokens).", gt=0)
    temperature: float = option(1.0, "GRPO: sampling temperature of the replies.", gt=0)
    top_k: int = option(0, "GRPO: sample from the k most likely tokens (0 = off).", ge=0)
    top_p: float = option(1.0, "GRPO: nucleus sampling of the replies.", gt=0, le=1)
    stop: tuple[str, ...] = option((), "GRPO: a reply ends at this text (repeatable).")


def parse_layers(value: str | list[int] | tuple[int, ...]) -> str:
    """``--init-from-teacher-layers``: layer numbers, comma-separated (``0,4,8``), as a string."""
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise LmcliError(f"invalid init-from-teacher-layers {value!r}: give layer numbers, e.g. 0,4,8")
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise LmcliError(f"invalid init-from-teacher-layers {value!r}: give layer numbers, e.g. 0,4,8")
    return ",".join(str(int(p)) for p in parts)


@dataclass(frozen=True)
class DistillConfig(Section):
    """``--task distill``: the student learns the teacher's next-token distribution
    (docs/distillation.md); ``lmcli tokenize --teacher`` reads ``teacher`` and the temperature."""

    TITLE: ClassVar[str] = "Distillation"

    teacher: str | None = option(
        None,
        "Distill: the teacher (an lmcli run or checkpoint, a Hugging Face folder or a GGUF file); the "
        "student takes its tokenizer.",
        path=True,
    )
    distill_loss: DistillLoss = option(
        "forward_kl",
        "Distill: forward_kl (the teacher's distribution covered), reverse_kl (its modes sought) or "
        "jsd (the generalized Jensen-Shannon divergence of --distill-beta).",
    )
    distill_beta: float = option(
        0.5, "Distill, jsd: the teacher's weight in the mixture both are compared with.", gt=0, lt=1
    )
    distill_temperature: float = option(
        1.0,
        "Distill: both distributions are softened by this temperature (the loss scaled by its square).",
        gt=0,
    )
    distill_alpha: float = option(
        1.0,
        "Distill: the weight of the divergence; 1 - alpha is the weight of the data's cross-entropy.",
        ge=0,
        le=1,
    )
    on_policy: float = option(
        0.0,
        "Distill: the fraction of each batch's rows the student samples itself (from the start of "
        "the row's window), scored token by token by the teacher (reverse KL), as in GKD.",
        ge=0,
        le=1,
    )
    on_policy_tokens: int = option(
        0, "Distill: tokens the student samples per on-policy row.", ge=0, default_help="half the context"
    )
    init_from_teacher_layers: str = option(
        "",
        "Distill: start the student from the teacher's embedding, these blocks (e.g. 0,4,8) and head.",
        parse=parse_layers,
        resume="fixed",
    )
    student_layers: int = option(
        0,
        "Distill: start the student from this many of the teacher's blocks, evenly spaced.",
        ge=0,
        resume="fixed",
    )

    @property
    def layers(self) -> tuple[int, ...]:
        """The numbers ``--init-from-teacher-layers`` gives."""
        return tuple(int(p) for p in self.init_from_teacher_layers.split(",") if p)

    @property
    def cut(self) -> bool:
        """Whether the student starts from the teacher's layers."""
        return bool(self.init_from_teacher_layers or self.student_layers)


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
        "lm (language modelling), translation (source <sep> target), sft (prompt/response or "
        "chat rows; the loss on the replies only), dpo (preference pairs), grpo (prompts and "
        "rewards): docs/post-training.md; distill (a teacher's distributions): docs/distillation.md.",
        resume="fixed",
    )
    init_from: str | None = option(
        None,
        "Start from a local Hugging Face folder (GPT-2, Llama, Qwen2, Mistral) or an lmcli run: "
        "fine-tuning, with its tokenizer and chat template.",
        path=True,
        resume="fixed",
    )
    allow_new_data: bool = option(
        False,
        "With --resume: continue on another corpus (or dataset, columns, validation data) than "
        "the run's own, which a resume otherwise refuses.",
        stored=False,  # asked each time: a resume of a resumed run is checked again
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
    post: PostTrainConfig = dataclasses.field(default_factory=PostTrainConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)

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

    @classmethod
    def on_resume(cls, kind: Literal["fixed", "free", "data"]) -> tuple[str, ...]:
        """The options (flat names) a resumed run must keep (``fixed``: its task, base and
        tokenizer), changes only with ``--allow-new-data`` (``data``), or may change (``free``)."""
        return tuple(f.name for _, f, _ in option_fields(cls) if (f.metadata.get("resume") or "free") == kind)

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
