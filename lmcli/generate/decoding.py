"""Pieces shared by sampling and beam search: prompts, prefill, one cached step, sliding window.

Every decoder goes through ``prefill`` (left-padded prompts into a fresh KV cache) and then
``step`` (one token per row through the cached model); when a row's context is full,
``slide`` re-prefills the last part of it. All of it is the model's one ``forward``; the
decoders run it inside ``lmcli.model.fastpath.inference``, which makes it faster on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lmcli.model.kv_cache import KVCache
from lmcli.model.transformer import Transformer
from lmcli.tasks import TextPrompt
from lmcli.text import chat_template
from lmcli.text.tokenizer import Tokenizer

TEXT = TextPrompt()  # ``<bos> text``, a language model's prompt


class ChatPrompt(TextPrompt):
    """A text as a user's message in the model's chat template (``lmcli sample --chat``): the
    prompt ends where the assistant's reply begins (the template puts ``<bos>`` where it wants
    one), and what is decoded is the reply alone."""

    shows_text = False

    def __init__(self, template: str | None) -> None:
        self.template = template  # a Hugging Face template, or None: lmcli's

    def encode(self, text: str, tokenizer: Tokenizer) -> list[int]:
        return chat_template.encode([{"role": "user", "content": text}], self.template, tokenizer)

    def frame(self, body: list[int], tokenizer: Tokenizer, block_size: int) -> tuple[list[int], bool]:
        return body, False


@dataclass
class Prompt:
    """A prompt's token ids and what encoding it found."""

    text: str
    ids: list[int]
    unknown: int = 0  # characters mapped to <unk>
    truncated: bool = False  # longer than the context: only its end was kept


def make_prompt(text: str, tokenizer: Tokenizer, block_size: int, form: TextPrompt = TEXT) -> Prompt:
    """``text`` as the ids of a prompt in the model's ``form`` (its task's: ``<bos> text``, or
    ``<bos> source <sep>`` for a translation model, whose source keeps at most half the context).

    A prompt longer than the context keeps its last ``block_size - 1`` tokens; a very long text
    is cut to what can be used before it is tokenized (``TextPrompt.usable``).
    """
    used, cut = form.usable(text, tokenizer, block_size)
    body = form.encode(used, tokenizer)
    ids, truncated = form.frame(body, tokenizer, block_size)
    if len(ids) > block_size - 1:
        ids, truncated = ids[-(block_size - 1) :], True
    return Prompt(text, ids, tokenizer.count_unknown(body), truncated or cut)


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token ids (B, T) padded on the left, and each row's first real column (B,)."""
    width = max(len(r) for r in rows)
    idx = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
    start = torch.tensor([width - len(r) for r in rows], dtype=torch.long)
    return idx.to(device), start.to(device)


def prefill(
    model: Transformer,
    rows: list[list[int]],
    pad_id: int,
    *,
    prefix_lm: bool = False,
    window_slack: int | None = None,
) -> tuple[KVCache, Tensor]:
    """Run the prompts through a new cache; return it and the next-token logits (B, V).

    With ``prefix_lm`` the whole prompt (a translation source) attends to itself both ways, as
    in training. ``window_slack`` (not None): the sliding-window layers keep only their window
    and that many more columns (``KVCache.for_model``); None: every column of every layer (a
    cache whose columns are copied elsewhere: the server's batch, the prefix cache).
    """
    device = next(model.parameters()).device
    idx, start = left_pad(rows, pad_id, device)
    cache = KVCache.for_model(model, len(rows), start=start, window_slack=None if prefix_lm else window_slack)
    prefix = torch.full((len(rows),), idx.size(1), device=device) if prefix_lm else None
    logits = model(idx, cache, prefix_len=prefix, last_only=True)
    return cache, logits[:, -1].float()


def step(model: Transformer, cache: KVCache, tokens: Tensor) -> Tensor:
    """Feed one token per row (B,); return the next-token logits (B, V)."""
    return model(tokens[:, None], cache, last_only=True)[:, -1].float()


def slide(
    model: Transformer, rows: list[list[int]], pad_id: int, window_slack: int | None = None
) -> tuple[KVCache, Tensor]:
    """The context is full: re-prefill each row's last half-context of tokens into a new cache."""
    keep = max(model.config.block_size // 2, 1)
    return prefill(model, [r[-keep:] for r in rows], pad_id, window_slack=window_slack)


def needs_slide(cache: KVCache) -> bool:
    return cache.length >= cache.max_len
