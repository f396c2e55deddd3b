"""What a model is trained to do: one object per task, chosen once from the config.

``make_task(cfg)`` picks the class of ``cfg.task`` (``TASKS``), as ``positions.make_positions``
picks a position scheme. Every task answers the same questions, most of them as a language
model does (the base class):

- ``prompt``: how text a user gives becomes a prompt, ``TextPrompt`` (``<bos> text``) or
  ``SourcePrompt`` (``<bos> source <sep>``, the source cut as in training), and whether the
  prompt attends to itself both ways (``prefix_lm``); sampling, beam search and the server take
  this object, never the task's name;
- ``chat``: whether ``lmcli chat`` and the server's chat completions apply (``refusal`` says
  why not, in the words of the command that refuses);
- ``examples``: what it trains on: None, windows of one token stream; else the reader of its
  supervised examples (``"pairs"``, ``"conversations"``), whose loss reads the response only.
  ``data/train_data.py`` builds the data from it, ``evaluate.evaluate_run`` scores by it;
- ``check``: the options that need this task (run when a ``TrainConfig`` is built);
- the defaults of ``--optimizer``, ``--schedule`` and ``--select``, and ``wants_bleu``: whether
  a validation also decodes for BLEU.

This module imports nothing of lmcli but ``errors``: ``config.py`` asks it while a
``TrainConfig`` is built, and data, training, evaluation, decoding and serving ask it in turn,
so it can import none of them (the configs and tokenizers it reads are passed in).
"""

from __future__ import annotations

from typing import Any, ClassVar

from lmcli.errors import LmcliError

BLEU_METRICS = ("val_bleu", "val_chrf")  # --select values only translation computes
CUT_MARGIN = 64  # tokens beyond the context kept when a long text is cut before it is tokenized
PREFERENCE_METRICS = ("val_accuracy", "val_margin")  # --select values only dpo computes
REWARD_METRICS = ("val_reward", "val_pass@1")  # --select values only grpo computes
# the post-training options (TrainConfig.post) each post-training task reads
DPO_OPTIONS = ("beta", "preference_loss", "simpo_gamma", "precompute_reference")
GRPO_OPTIONS = (
    "reward", "group_size", "kl_coef", "ratio_clip", "grpo_steps",
    "max_new_tokens", "temperature", "top_k", "top_p", "stop",
)  # fmt: skip
# the distillation options (TrainConfig.distill) only --task distill reads
DISTILL_OPTIONS = (
    "teacher", "distill_loss", "distill_beta", "distill_temperature", "distill_alpha",
    "on_policy", "on_policy_tokens", "init_from_teacher_layers", "student_layers",
)  # fmt: skip


class TextPrompt:
    """``<bos> text``: how a language model reads a prompt (an empty text is ``<bos>`` alone);
    ``text`` alone for a tokenizer that puts no ``<bos>`` first (``Tokenizer.with_bos``: an
    imported model whose source says ``add_bos_token: false``)."""

    prefix_lm = False  # the prompt attends causally, as every position in training
    shows_text = True  # a continuation reads on from its prompt's text (lmcli sample prints both)
    keeps_end = True  # a text longer than the context keeps its end (a source: its beginning)

    def encode(self, text: str, tokenizer: Any) -> list[int]:
        """The ids of a user's text (``frame`` puts the prompt's own tokens around them)."""
        return tokenizer.encode(text)

    def usable_chars(self, tokenizer: Any, block_size: int) -> int:
        """Characters of a text that can reach a prompt: enough for ``block_size + CUT_MARGIN``
        tokens at least (``Tokenizer.longest_token`` characters each, times 4 for what a
        normalizer may join), so a 100 MB line is read and tokenized as a context's worth."""
        return (block_size + CUT_MARGIN) * tokenizer.longest_token * 4

    def usable(self, text: str, tokenizer: Any, block_size: int) -> tuple[str, bool]:
        """The part of ``text`` a prompt can use, cut before it is tokenized (``usable_chars``:
        its end, or with ``keeps_end`` false its beginning), and whether it was cut. The kept
        tokens are those of the whole text but for the few at the cut, which the margin drops."""
        limit = self.usable_chars(tokenizer, block_size)
        if len(text) <= limit:
            return text, False
        return (text[-limit:] if self.keeps_end else text[:limit]), True

    def frame(self, body: list[int], tokenizer: Any, block_size: int) -> tuple[list[int], bool]:
        """The prompt's ids around the text's ids ``body``, and whether part of ``body`` was left
        out; fitting the prompt in the context is the decoder's (``decoding.make_prompt``)."""
        return tokenizer.with_bos(body), False

    def input_length(self, ids: list[int]) -> int:
        """The length in tokens of the input a prompt holds (beam search's ``a * length + b``)."""
        return len(ids)

    def decodes(self, text: str) -> bool:
        """Whether ``text`` is decoded at all (an empty prompt is: it starts from ``<bos>``)."""
        return True


class SourcePrompt(TextPrompt):
    """``<bos> source <sep>``: how a translation model reads a source. The source keeps at most
    half the context, as in training; an empty source has an empty translation."""

    shows_text = False
    keeps_end = False

    def __init__(self, prefix_lm: bool = False) -> None:
        self.prefix_lm = prefix_lm  # the source attends to itself both ways (--prefix-lm)

    def frame(self, body: list[int], tokenizer: Any, block_size: int) -> tuple[list[int], bool]:
        if tokenizer.sep_id is None:
            raise LmcliError("the tokenizer has no <sep> token, which translation needs")
        ids = [tokenizer.bos_id, *body[: max((block_size + 1) // 2 - 2, 1)], tokenizer.sep_id]
        return ids, len(ids) < len(body) + 2

    def input_length(self, ids: list[int]) -> int:
        return len(ids) - 2  # without <bos> and <sep>

    def decodes(self, text: str) -> bool:
        return bool(text.strip())


class Task:
    """The answers every task gives unless it says otherwise (those of a language model)."""

    name: ClassVar[str]
    described: ClassVar[str]  # "a ... model", in messages
    chat: ClassVar[bool] = True  # lmcli chat and the server's chat completions apply
    examples: ClassVar[str | None] = None  # None: windows of a token stream; else the examples' reader
    example_noun: ClassVar[str] = ""  # "pair(s)": what messages about the examples count
    val_hint: ClassVar[str] = ""  # the options that give separate validation examples
    scored: ClassVar[str] = ""  # the part of an example the loss reads ("target", "reply")
    reads_pair_files: ClassVar[bool] = False  # lmcli eval --source/--target apply
    own_split: ClassVar[bool] = True  # lmcli eval RUN alone scores the run's validation examples
    post_options: ClassVar[tuple[str, ...]] = ()  # the TrainConfig.post options it reads
    # TrainConfig values it takes unless a config file or an option gives them
    defaults: ClassVar[dict[str, Any]] = {}
    metrics: ClassVar[tuple[str, ...]] = ()  # the --select values only it computes
    whole: ClassVar[str] = ""  # what needs whole weights on every rank (--parallel fsdp refused)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg  # the TrainConfig

    @property
    def prompt(self) -> TextPrompt:
        return TextPrompt()

    @property
    def prefix_lm(self) -> bool:
        """Whether prompts (training's and decoding's) attend to themselves both ways."""
        return self.prompt.prefix_lm

    def refusal(self, advice: str) -> str:
        """Why a command does not apply to this model, and ``advice``: one line."""
        return f"this is {self.described}: {advice}"

    def check(self) -> None:
        """Refuse options this task cannot use (one line, as every option error)."""
        pairs, select = self.cfg.translation, self.cfg.validation.select
        if pairs.source or pairs.target or pairs.val_source or pairs.prefix_lm:
            raise LmcliError("--source, --target, --val-source and --prefix-lm need --task translation")
        if select in BLEU_METRICS:
            raise LmcliError(f"--select {select} needs --task translation and --bleu-samples above 0")
        self.check_post()

    def check_post(self) -> None:
        """Refuse post-training and distillation options and metrics of another task
        (``--reward`` with sft, ``--teacher`` with lm)."""
        distill = self.cfg.distill
        if self.name != "distill":
            changed = [o for o in DISTILL_OPTIONS if getattr(distill, o) != getattr(type(distill)(), o)]
            if changed:
                raise LmcliError(f"--{changed[0].replace('_', '-')} needs --task distill")
        post, select = self.cfg.post, self.cfg.validation.select
        for name, task, options in (("dpo", Preference, DPO_OPTIONS), ("grpo", Reinforcement, GRPO_OPTIONS)):
            if self.name == name:
                continue
            changed = [o for o in options if getattr(post, o) != getattr(type(post)(), o)]
            if changed:
                raise LmcliError(f"--{changed[0].replace('_', '-')} needs --task {name}")
            if select in task.metrics:
                raise LmcliError(f"--select {select} needs --task {name}")

    def sequences(self) -> int:
        """Sequences a training step runs per example (a pair: 2; a prompt: its G replies)."""
        return 1

    def default_optimizer(self) -> str:
        """``--optimizer auto``: AdamW."""
        return "adamw"

    def default_schedule(self) -> str:
        """``--schedule auto``: cosine."""
        return "cosine"

    def default_metric(self) -> str:
        """The validation metric ``best/`` follows without ``--select``."""
        return "val_loss"

    def wants_bleu(self, step: int) -> bool:
        """Whether the validation at ``step`` also decodes validation examples for BLEU."""
        return False

    def decodes_bleu(self) -> bool:
        """Whether any validation decodes for BLEU (``wants_bleu`` at some step)."""
        return False


class LanguageModel(Task):
    """``--task lm``: next-token prediction on windows of a token stream."""

    name = "lm"
    described = "a language model"

    def default_optimizer(self) -> str:
        """Muon from scratch (where it was measured, docs/time-to-quality.md); AdamW for
        fine-tuning (``--init-from``: LoRA's low-rank adapters are no matrices for Muon)."""
        return "adamw" if self.cfg.init_from else "muon"

    def default_schedule(self) -> str:
        """wsd with Muon from scratch, cosine for fine-tuning."""
        return "cosine" if self.cfg.init_from else "wsd"


class Translation(Task):
    """``--task translation``: ``<bos> source <sep> target <eos>`` pairs, the loss on the target;
    decoding reads a source, validation can report greedy BLEU."""

    name = "translation"
    described = "a translation model"
    chat = False
    examples = "pairs"
    example_noun = "pair(s)"
    val_hint = "--val-source/--val-target"
    defaults = {"tokenizer": "bpe"}  # a joint subword vocabulary over both languages
    scored = "target"
    reads_pair_files = True

    @property
    def prompt(self) -> TextPrompt:
        return SourcePrompt(self.cfg.translation.prefix_lm)

    def check(self) -> None:
        val = self.cfg.validation
        if val.select in BLEU_METRICS and not val.bleu_samples:
            raise LmcliError(f"--select {val.select} needs --task translation and --bleu-samples above 0")
        self.check_post()

    def default_metric(self) -> str:
        return "val_bleu" if self.cfg.validation.bleu_samples else "val_loss"

    def wants_bleu(self, step: int) -> bool:
        val = self.cfg.validation
        return self.decodes_bleu() and (not val.bleu_interval or step % val.bleu_interval == 0)

    def decodes_bleu(self) -> bool:
        return bool(self.cfg.validation.bleu_samples)


class Supervised(Task):
    """``--task sft``: prompt/response or chat rows rendered with the chat template, the loss on
    the replies; decoding reads text as a language model does (``lmcli chat`` renders turns)."""

    name = "sft"
    described = "an SFT model"
    examples = "conversations"
    example_noun = "conversation(s)"
    val_hint = "--val FILE"
    scored = "reply"


class PostTraining(Task):
    """What ``--task dpo`` and ``--task grpo`` share: a model to start from (the reference),
    rows in the chat template, the loss on replies; decoding as an SFT model."""

    example_noun = "row(s)"
    val_hint = "--val FILE"
    scored = "reply"
    own_split = False
    whole = "its reference and rollouts"

    def check(self) -> None:
        super().check()
        if not self.cfg.init_from:
            raise LmcliError(
                f"--task {self.name} tunes a model: give --init-from (a run folder, a Hugging Face "
                "folder or a GGUF file)"
            )


class Preference(PostTraining):
    """``--task dpo``: preference pairs, DPO's loss (or IPO's, SimPO's) against the reference."""

    name = "dpo"
    described = "a preference-tuned model"
    examples = "preferences"
    example_noun = "pair(s)"
    post_options = DPO_OPTIONS
    metrics = PREFERENCE_METRICS

    def sequences(self) -> int:
        return 2

    def check(self) -> None:
        super().check()
        post = self.cfg.post
        if post.precompute_reference and post.preference_loss == "simpo":
            raise LmcliError("--precompute-reference: --preference-loss simpo reads no reference")


class Reinforcement(PostTraining):
    """``--task grpo``: prompts, replies sampled in groups and rewarded, GRPO's clipped objective;
    ``best/`` follows the validation reward."""

    name = "grpo"
    described = "an RL-tuned model"
    examples = "prompts"
    example_noun = "prompt(s)"
    post_options = GRPO_OPTIONS
    metrics = REWARD_METRICS

    def check(self) -> None:
        super().check()
        if not self.cfg.post.reward:
            raise LmcliError("--task grpo needs --reward (e.g. --reward number; docs/post-training.md)")

    def sequences(self) -> int:
        return self.cfg.post.group_size

    def default_metric(self) -> str:
        return "val_reward"


class Distillation(LanguageModel):
    """``--task distill``: windows of a token stream, as a language model, the loss against a
    teacher's next-token distributions (``--teacher``) instead of (or beside, ``--distill-alpha``)
    the data's next token; the student takes the teacher's tokenizer."""

    name = "distill"
    described = "a distilled language model"
    whole = "its teacher and on-policy samples"

    def check(self) -> None:
        super().check()
        distill, cfg = self.cfg.distill, self.cfg
        if not distill.teacher:
            raise LmcliError(
                "--task distill needs --teacher MODEL (a run folder, a Hugging Face folder or a GGUF file)"
            )
        if distill.init_from_teacher_layers and distill.student_layers:
            raise LmcliError("give --init-from-teacher-layers or --student-layers, not both")
        if distill.cut and cfg.init_from:
            raise LmcliError(
                "--init-from-teacher-layers and --student-layers start the student from the teacher: "
                "drop --init-from"
            )
        if distill.distill_loss != "jsd" and distill.distill_beta != type(distill)().distill_beta:
            raise LmcliError("--distill-beta weighs the teacher in jsd: give --distill-loss jsd")
        if distill.on_policy_tokens and not distill.on_policy:
            raise LmcliError("--on-policy-tokens needs --on-policy FRACTION above 0")

    def default_optimizer(self) -> str:
        """Muon for a student from scratch; AdamW for one that starts from weights."""
        return "adamw" if self.cfg.init_from or self.cfg.distill.cut else "muon"

    def default_schedule(self) -> str:
        return "cosine" if self.cfg.init_from or self.cfg.distill.cut else "wsd"


TASKS: dict[str, type[Task]] = {
    "lm": LanguageModel,
    "translation": Translation,
    "sft": Supervised,
    "dpo": Preference,
    "grpo": Reinforcement,
    "distill": Distillation,
}


def make_task(cfg: Any) -> Task:
    """The task of a ``TrainConfig`` (its ``task`` option)."""
    return TASKS[cfg.task](cfg)
