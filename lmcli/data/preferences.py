"""Post-training data: preference pairs for ``--task dpo`` and prompts for ``--task grpo``.

A preference row is ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (text; optionally
``"system"``) or ``{"messages": [...], "chosen": {...}, "rejected": {...}}`` (the conversation so
far, ending with a user turn, and two assistant messages; a reply may also be given as its text,
or as a list of one assistant message). As ``--task sft`` reads ``{"prompt", "response"}``, the
prompt is the user's turn and every conversation is rendered in the model's chat template
(``chat_template.encode_conversation``); the loss reads the final reply's tokens and its end
token only (earlier assistant turns are context).

A prompt row for ``--task grpo`` is ``{"prompt": ...}`` or ``{"messages": [...]}`` ending with a
user turn, plus whatever its rewards read (``"answer"``, ``"schema"``, ...): its ids end where
the reply begins (the template's generation prompt).

Rows come from what ``ConversationRows`` reads (JSONL, a JSON list, parquet, a ``datasets``
name). A bad row is one line naming it (``file:line``): a missing or empty reply, a conversation
out of order, a pair longer than the context, a prompt that leaves no room for a reply.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from lmcli.config.train import TrainConfig
from lmcli.data.conversations import ConversationRows, conversation
from lmcli.data.examples import Encoded, ExampleSet, collate
from lmcli.data.train_data import ExampleData
from lmcli.data.windows import Batch, EpochStream
from lmcli.errors import LmcliError
from lmcli.text.chat_template import (
    Message,
    Renderer,
    Template,
    check_messages,
    check_roles,
    encode,
    encode_conversation,
)
from lmcli.text.tokenizer import Tokenizer

SIDES = ("chosen", "rejected")
RowCheck = Callable[[dict[str, Any], str], None]  # a reward's check of a row (and where it is)
T = TypeVar("T")


@dataclass
class PreferencePair:
    """One pair, both sides rendered: ids and the tokens the loss reads (the final reply)."""

    where: str
    chosen: Encoded
    rejected: Encoded


@dataclass
class PromptRow:
    """One GRPO prompt: where it is, its row (what rewards read), its text and its ids."""

    where: str
    row: dict[str, Any]
    text: str  # the row's prompt, or its last user message: what a reward function reads
    ids: list[int]  # the rendered prompt, ending where the reply begins


def prompt_messages(row: Any, where: str) -> list[Message]:
    """The conversation a row's reply answers: checked, ending with a user turn."""
    if not isinstance(row, dict):
        raise LmcliError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "messages" in row and "prompt" in row:
        raise LmcliError(f'{where}: the row holds both "prompt" and "messages": give one')
    if "messages" in row or isinstance(row.get("prompt"), list):
        raw = row["messages"] if "messages" in row else row["prompt"]
        try:
            messages = check_roles(check_messages(raw))
        except LmcliError as exc:
            raise LmcliError(f"{where}: {exc}") from None
        return messages
    if not isinstance(row.get("prompt"), str):
        raise LmcliError(
            f'{where}: expected "prompt" (text) or "messages" (found: {", ".join(row) or "nothing"})'
        )
    messages = [{"role": "user", "content": row["prompt"]}]
    if row.get("system") is not None:
        if not isinstance(row["system"], str):
            raise LmcliError(f'{where}: "system" must be text')
        messages.insert(0, {"role": "system", "content": row["system"]})
    return messages


def reply_text(row: dict[str, Any], side: str, where: str) -> str:
    """The text of a row's ``chosen`` or ``rejected`` reply; missing or empty: one line."""
    if side not in row:
        raise LmcliError(f'{where}: no "{side}" reply (a preference row has "chosen" and "rejected")')
    reply = row[side]
    if isinstance(reply, list) and len(reply) == 1:
        reply = reply[0]
    if isinstance(reply, dict):
        if reply.get("role", "assistant") != "assistant":
            raise LmcliError(
                f'{where}: the "{side}" reply has role {reply.get("role")!r}, expected "assistant"'
            )
        reply = reply.get("content")
    if not isinstance(reply, str):
        raise LmcliError(f'{where}: the "{side}" reply must be text or an assistant message')
    if not reply.strip():
        raise LmcliError(f'{where}: the "{side}" reply is empty')
    return reply


def last_reply(scored: list[bool]) -> list[bool]:
    """``scored`` keeping only its last run of true values: the final reply and its end token."""
    end = len(scored) - scored[::-1].index(True)  # one past the last scored token
    start = end
    while start > 0 and scored[start - 1]:
        start -= 1
    return [start <= i < end for i in range(len(scored))]


def _template(tok: Tokenizer) -> Template | None:
    return Template(tok.chat_template, tok.origin or "the tokenizer") if tok.chat_template else None


def chars_bound(tok: Tokenizer, max_len: int) -> int:
    """Characters past which a text certainly holds more than ``max_len`` tokens: a token spells
    at most ``Tokenizer.longest_token`` characters (times 4 for what a normalizer may join). A
    row longer is refused before it is rendered or tokenized: a 40 MB reply costs nothing."""
    return max_len * tok.longest_token * 4


def _chars(messages: list[Message]) -> int:
    return sum(len(m["content"]) for m in messages)


@dataclass
class Rendering:
    """How the rows of a file become ids: the tokenizer, its chat template, one renderer, and the
    most tokens a sequence may have (``max_len``; ``bound``: its characters, ``chars_bound``)."""

    tok: Tokenizer
    template: Template | None
    renderer: Renderer
    max_len: int

    def __post_init__(self) -> None:
        self.bound = chars_bound(self.tok, self.max_len)

    def reply(self, messages: list[Message], side: str, text: str, where: str) -> Encoded:
        """The ``side`` reply after its prompt, rendered and tokenized, the loss on it; too long:
        one line naming the row (refused before it is rendered when its characters say so)."""
        chars = _chars(messages) + len(text)
        if chars > self.bound:
            raise LmcliError(
                f'{where}: the prompt and its "{side}" reply are {chars:,} characters, more than the '
                f"context allows ({self.max_len} tokens)"
            )
        full = conversation({"messages": [*messages, {"role": "assistant", "content": text}]}, where)
        ids, scored = encode_conversation(full, self.template, self.tok, renderer=self.renderer)
        if len(ids) > self.max_len:
            raise LmcliError(
                f'{where}: the prompt and its "{side}" reply are {len(ids)} tokens, more than '
                f"the context allows ({self.max_len})"
            )
        scored = last_reply(scored)
        return Encoded(ids, scored, scored.index(True))


class PreferenceRows:
    """Preference pairs from a file or ``datasets`` name (``split`` for those)."""

    def __init__(self, spec: str, split: str = "train") -> None:
        self.source = ConversationRows(spec, split)
        self.description = self.source.description

    def pairs(self, tok: Tokenizer, max_len: int) -> list[PreferencePair]:
        """Every pair rendered; a pair whose prompt and reply pass ``max_len`` tokens is refused;
        a pair whose two replies are the same text (it teaches nothing: the loss is log 2, the
        gradient zero) is skipped, with one warning counting them."""
        out, same = [], []
        with Renderer() as renderer:
            rendering = Rendering(tok, _template(tok), renderer, max_len)
            for where, row in self.source.rows():
                messages = prompt_messages(row, where)
                texts = [reply_text(row, side, where) for side in SIDES]
                if texts[0] == texts[1]:
                    same.append(where)
                    continue
                sides = [
                    rendering.reply(messages, side, text, where)
                    for side, text in zip(SIDES, texts, strict=True)
                ]
                out.append(PreferencePair(where, *sides))
        if same:
            print(
                f"warning: {self.description}: skipped {len(same)} pair(s) whose chosen and rejected "
                f"replies are the same (the first: {same[0]}): they teach nothing",
                file=sys.stderr,
            )
        if not out:
            raise LmcliError(f"no preference pairs in {self.description}")
        return out


class PromptRows:
    """GRPO prompts from a file or ``datasets`` name (``split`` for those)."""

    def __init__(self, spec: str, split: str = "train") -> None:
        self.source = ConversationRows(spec, split)
        self.description = self.source.description

    def prompts(self, tok: Tokenizer, max_len: int, check: RowCheck | None = None) -> list[PromptRow]:
        """Every prompt rendered; one that leaves no room for a reply within ``max_len`` tokens is
        refused; ``check(row, where)``: the rewards' own check of a row."""
        template, out = _template(tok), []
        bound = chars_bound(tok, max_len)
        with Renderer() as renderer:
            for where, row in self.source.rows():
                messages = prompt_messages(row, where)
                if check is not None:
                    check(row, where)
                if _chars(messages) > bound:  # certainly too long: refused before it is rendered
                    raise LmcliError(
                        f"{where}: the prompt is {_chars(messages):,} characters: no room for a reply in "
                        f"the context ({max_len} tokens)"
                    )
                ids = encode(messages, template, tok, renderer=renderer)
                if len(ids) >= max_len:
                    raise LmcliError(
                        f"{where}: the prompt is {len(ids)} tokens: no room for a reply in the context "
                        f"({max_len})"
                    )
                text = row["prompt"] if isinstance(row.get("prompt"), str) else messages[-1]["content"]
                out.append(PromptRow(where, row, text, ids))
        if not out:
            raise LmcliError(f"no prompts in {self.description}")
        return out


# ----------------------------------------------------------------------------- batches


def example_set(encoded: list[Encoded]) -> ExampleSet:
    """Encoded sequences as an in-memory ``ExampleSet`` (``collate`` pads and indexes them)."""
    lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.array([t for e in encoded for t in e.ids], dtype=np.int64)
    scored = np.array([s for e in encoded for s in e.scored], dtype=np.uint8)
    prefix = np.array([e.prefix for e in encoded], dtype=np.int64)
    return ExampleSet(tokens, scored, offsets, lengths, prefix)


def pair_set(pairs: list[PreferencePair]) -> ExampleSet:
    """Pair ``i``'s chosen sequence at ``2i``, its rejected one at ``2i + 1``."""
    return example_set([e for p in pairs for e in (p.chosen, p.rejected)])


@dataclass
class PairBatch(Batch):
    """A batch of pairs: rows ``2i`` (chosen) and ``2i + 1`` (rejected) are pair ``pairs[i]``."""

    pairs: torch.Tensor | None = None  # (B,) the pairs' indices in their set (host)

    def to(self, device: torch.device, staging: Any = None) -> PairBatch:
        moved = Batch.to(self, device, staging)
        return PairBatch(
            moved.x, moved.y, moved.prefix_len, moved.tokens, moved.index, moved.document, self.pairs
        )


def collate_pairs(
    sequences: ExampleSet, pairs: list[int] | np.ndarray, pad_id: int, context: int, multiple: int = 1
) -> PairBatch:
    """The chosen and rejected sequences of ``pairs``, interleaved, as one padded batch."""
    rows = [k for i in pairs for k in (2 * int(i), 2 * int(i) + 1)]
    b = collate(sequences, rows, pad_id, context, multiple)
    return PairBatch(
        b.x, b.y, b.prefix_len, index=b.index, pairs=torch.as_tensor(np.asarray(pairs, dtype=np.int64))
    )


class PairSampler(EpochStream):
    """Batches of pairs, without replacement within an epoch (seeded order); the position is
    pairs consumed."""

    def __init__(
        self, sequences: ExampleSet, seed: int, pad_id: int, context: int, multiple: int = 1
    ) -> None:
        super().__init__(len(sequences) // 2, seed)
        self.sequences, self.pad_id, self.context, self.multiple = sequences, pad_id, context, multiple

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.epoch_size)

    def batch(self, first: int, count: int) -> PairBatch:
        return collate_pairs(
            self.sequences, self.take(first, count), self.pad_id, self.context, self.multiple
        )


@dataclass
class PreferenceData(ExampleData):
    """``--task dpo``: train and validation pairs, each set holding its pairs' two sequences."""

    @property
    def n_pairs(self) -> int:
        return len(self.train) // 2

    def sampler(self, batch_size: int, seed: int) -> PairSampler:
        return PairSampler(self.train, seed, self.tokenizer.pad_id, self.block_size, self.pad_multiple)

    def tokens_per_example(self) -> float:
        return 2 * float(self.train.length.mean())  # a pair: both sequences

    def val_batches(self, batch_size: int, limit: int, rank: int = 0, world: int = 1) -> Iterator[PairBatch]:
        """The first ``limit`` validation pairs (this rank's share), ``batch_size`` at a time."""
        pairs = np.arange(min(limit, len(self.val) // 2))[rank::world]
        for i in range(0, len(pairs), batch_size):
            yield collate_pairs(self.val, pairs[i : i + batch_size], self.tokenizer.pad_id, self.block_size)


class PromptSampler(EpochStream):
    """Prompts, without replacement within an epoch (seeded order); the position is prompts consumed."""

    def __init__(self, prompts: list[PromptRow], seed: int) -> None:
        super().__init__(len(prompts), seed)
        self.prompts = prompts

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.epoch_size)

    def batch(self, first: int, count: int) -> list[PromptRow]:
        return [self.prompts[i] for i in self.take(first, count)]


@dataclass
class PromptData:
    """``--task grpo``: train and validation prompts."""

    tokenizer: Tokenizer
    train: list[PromptRow]
    val: list[PromptRow]
    block_size: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def train_tokens(self) -> int:
        return sum(len(p.ids) for p in self.train)

    @property
    def val_tokens(self) -> int:
        return sum(len(p.ids) for p in self.val)

    def sampler(self, batch_size: int, seed: int) -> PromptSampler:
        return PromptSampler(self.train, seed)

    def tokens_per_example(self) -> float:
        return self.train_tokens / len(self.train)

    def longest_example(self) -> int:
        return self.block_size


# ----------------------------------------------------------------------------- a run's data


def _rows_of(cfg: TrainConfig, noun: str, validation: bool) -> str | None:
    """The file (or dataset) of a run's ``noun`` (preference pairs, prompts), or of its validation
    ones."""
    data = cfg.data
    if validation:
        return data.val
    if data.dataset:
        return data.dataset
    if len(data.corpus) == 1:
        return data.corpus[0]
    raise LmcliError(f"--task {cfg.task} needs one file of {noun} (JSONL, JSON or parquet) or --dataset")


def _split(items: list[T], cfg: TrainConfig, noun: str) -> tuple[list[T], list[T]]:
    """Training and validation parts: the last ``--val-fraction`` held out."""
    n_val = int(len(items) * cfg.data.val_fraction)
    if n_val < 1:
        raise LmcliError(f"no validation {noun}: give --val FILE or a larger --val-fraction")
    return items[: len(items) - n_val], items[len(items) - n_val :]


def load_preference_data(cfg: TrainConfig, block_size: int, tok: Tokenizer) -> PreferenceData:
    """``--task dpo``: the pairs (and held-out pairs), rendered; a pair longer than the context
    is refused."""
    spec = _rows_of(cfg, "preference pairs", False)
    assert spec is not None
    rows = PreferenceRows(spec, cfg.data.split)
    pairs = rows.pairs(tok, block_size + 1)
    val_spec = _rows_of(cfg, "preference pairs", True)
    if val_spec is not None:
        train, val = pairs, PreferenceRows(val_spec).pairs(tok, block_size + 1)
    else:
        train, val = _split(pairs, cfg, "pairs")
    info = {"corpus": rows.description, "examples": len(train)}
    return PreferenceData(tok, pair_set(train), pair_set(val), block_size, info)


def load_prompt_data(cfg: TrainConfig, block_size: int, tok: Tokenizer, check: RowCheck | None) -> PromptData:
    """``--task grpo``: the prompts (and held-out prompts), rendered and checked by the rewards
    (``check(row, where)``); a prompt that leaves no room for a reply is refused."""
    spec = _rows_of(cfg, "prompts", False)
    assert spec is not None
    rows = PromptRows(spec, cfg.data.split)
    prompts = rows.prompts(tok, block_size, check)
    val_spec = _rows_of(cfg, "prompts", True)
    if val_spec is not None:
        train, val = prompts, PromptRows(val_spec).prompts(tok, block_size, check)
    else:
        train, val = _split(prompts, cfg, "prompts")
    return PromptData(tok, train, val, block_size, {"corpus": rows.description, "examples": len(train)})
