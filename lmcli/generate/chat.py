"""A chat session: the conversation, its prompt in the model's chat template, replies from
the row engine, the prefix cache reused between turns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmcli.config.commands import SampleConfig
from lmcli.config.fields import SEED_MAX
from lmcli.errors import LmcliError
from lmcli.generate.engine import RowProcessor
from lmcli.model.transformer import Transformer
from lmcli.safe_io import atomic_write, refuse_special
from lmcli.tasks import make_task
from lmcli.text import chat_template
from lmcli.text.chat_template import Message, Renderer, RenderTooLong, Template, check_roles
from lmcli.text.tokenizer import Tokenizer

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # as lmcli serve reports them


@dataclass
class Reply:
    """One assistant reply and how it ended."""

    text: str
    finish_reason: str  # "stop" (end of turn or a stop string), "length", or "interrupted"
    prompt_tokens: int
    completion_tokens: int
    dropped: int = 0  # messages left out of the prompt for this reply to fit the context


class ChatSession:
    """A conversation with one model: its messages, the rendering, and the replies."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cfg: SampleConfig,
        template: Template | str | None = None,
        system: str | None = None,
        draft: Any = None,
        processors: Callable[[], tuple[RowProcessor, ...]] = tuple,
    ) -> None:
        """``template``: the model folder's Hugging Face chat template, or None for lmcli's.
        ``draft``: a ``speculative.Draft`` that replies are decoded with (the same replies).
        ``processors()``: each reply's own processors (a grammar's mask: ``--json-schema``)."""
        if cfg.num_samples != 1:
            raise LmcliError("a chat reply is one sample: num-samples must be 1")
        self.model, self.tokenizer, self.cfg, self.processors = model, tokenizer, cfg, processors
        self.template = chat_template.as_template(template)
        self.renderer = Renderer() if self.template is not None else None
        self.draft = draft
        self.system = system or None
        self.messages: list[Message] = []  # user and assistant messages, oldest first
        self.first = 0  # messages[first:] are in the prompt; older ones were dropped
        self.prefixes: Any = None  # the PrefixCache of the conversation, made at the first reply

    def close(self) -> None:
        """Stop the template's renderer (a session that renders none holds nothing)."""
        if self.renderer is not None:
            self.renderer.close()

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Any,
        cfg: SampleConfig,
        system: str | None = None,
        draft: Any = None,
        processors: Callable[[], tuple[RowProcessor, ...]] = tuple,
    ) -> ChatSession:
        """A session with a loaded checkpoint, rendered with its folder's template (as serve does)."""
        task = make_task(ckpt.train_config)
        if not task.chat:
            raise LmcliError(task.refusal("use lmcli sample or lmcli beam"))
        template = chat_template.template_of(ckpt)
        return cls(ckpt.model, ckpt.tokenizer, cfg, template, system, draft, processors)

    @property
    def context(self) -> int:
        return self.model.config.block_size

    def conversation(self) -> list[Message]:
        """The whole conversation as ``messages`` (system prompt first), dropped turns included."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    def window(self, first: int | None = None) -> list[Message]:
        """The messages the next prompt renders: the system prompt and the turns not dropped
        (or those from message ``first`` on)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages[self.first if first is None else first :]

    def prompt_ids(self, first: int | None = None) -> list[int]:
        """The token ids of the prompt for the next reply (ends where the reply begins), from
        message ``first`` on (default: the turns not dropped). ``RenderTooLong`` when it has more
        characters than the context can hold in tokens (it is not tokenized)."""
        bound = self.context * self.tokenizer.longest_token
        return chat_template.encode(
            self.window(first), self.template, self.tokenizer, renderer=self.renderer, max_chars=bound
        )

    def reset(self) -> None:
        """Forget every message (the system prompt stays)."""
        self.messages, self.first = [], 0

    def set_system(self, text: str | None) -> None:
        """Set (or with None/'' clear) the system prompt; it applies from the next reply on."""
        self.system = text or None

    def load(self, messages: Any) -> None:
        """Replace the conversation with ``messages`` (a system message may come first only)."""
        messages = check_roles(chat_template.check_messages(messages))
        if messages[0]["role"] == "system":
            if self.system is not None:
                raise LmcliError("give the system prompt once: --system or a system message")
            self.system, messages = messages[0]["content"] or None, messages[1:]
        self.messages, self.first = messages, 0

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """Add the user's message and reply to it (see ``reply``). A message that cannot fit
        the context is not kept."""
        self.messages.append({"role": "user", "content": text})
        try:
            return self.reply(on_text)
        except LmcliError:
            self.messages.pop()
            raise

    def reply(self, on_text: Callable[[str], None] | None = None) -> Reply:
        """Generate the assistant's reply to the conversation (whose last message is the user's),
        add it to the conversation and return it; ``on_text(piece)`` receives its text as it is
        decoded. A ``KeyboardInterrupt`` stops the reply (see the module docstring)."""
        from lmcli.generate.sampling import generate

        if not self.messages or self.messages[-1]["role"] != "user":
            raise LmcliError("the last message must be the user's")
        ids: list[int] = []
        dropped = 0
        shown: list[str] = []

        def stream(_row: int, piece: str) -> None:
            shown.append(piece)
            if on_text is not None:
                on_text(piece)

        try:
            ids, dropped = self._fit()
            cfg = replace(
                self.cfg,
                max_new_tokens=min(self.cfg.max_new_tokens, self.context - len(ids)),
                seed=self.reply_seed(),
            )
            rules = {"on_text": stream, "draft": self.draft, "processors": self.processors}
            g = generate(self.model, self.tokenizer, [ids], cfg, prefixes=self._prefixes(), **rules)[0]
        except KeyboardInterrupt:
            text = "".join(shown)
            if text:
                self.messages.append({"role": "assistant", "content": text})
            else:
                self.messages.pop()  # nothing was shown: forget the question too
            n = len(self.tokenizer.encode(text)) if text else 0
            return Reply(text, "interrupted", len(ids), n, dropped)
        self.messages.append({"role": "assistant", "content": g.text})
        tokens = len(g.ids) + (g.finish_reason == "eos")
        return Reply(g.text, FINISH[g.finish_reason], len(ids), tokens, dropped)

    def _prefixes(self) -> Any:
        """The session's prefix cache: room for two context windows of keys and values."""
        if self.prefixes is None:
            from lmcli.generate.prefix_cache import PrefixCache
            from lmcli.model.kv_cache import cache_dtype, value_bytes

            cfg = self.model.config
            itemsize = value_bytes(cache_dtype(self.model))
            window = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * self.context * itemsize
            self.prefixes = PrefixCache(int(2 * window))
        return self.prefixes

    def reply_seed(self) -> int:
        """The seed of the next reply: ``seed`` plus the replies before it in the conversation
        (so the replies of a session do not share their random draws, and the same conversation
        gets the same reply, here, with ``--json`` or from ``lmcli serve``)."""
        replies = sum(m["role"] == "assistant" for m in self.messages)
        return (self.cfg.seed + replies) % (SEED_MAX + 1)

    def _fit(self) -> tuple[list[int], int]:
        """The prompt's ids after dropping the oldest turns until prompt + max_new_tokens fits
        the context, and how many messages were dropped; one line if the newest turn alone
        leaves no room for a reply. The first turn kept is found by bisection (a prompt is no
        longer for starting later), so a long conversation costs a few renders, not one per turn."""
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        starts = [self.first] + [
            i for i in range(self.first + 1, last_user + 1) if self.messages[i]["role"] == "user"
        ]
        probed: dict[int, list[int] | None] = {}  # start -> ids (None: more than the context holds)

        def ids_from(j: int) -> list[int] | None:
            if j not in probed:
                try:
                    probed[j] = self.prompt_ids(starts[j])
                except RenderTooLong:
                    probed[j] = None
            return probed[j]

        def fits(j: int) -> bool:
            ids = ids_from(j)
            return ids is not None and len(ids) + self.cfg.max_new_tokens <= self.context

        lo, hi = 0, len(starts) - 1  # the first start that fits, or the last one
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        ids = ids_from(lo)
        if ids is None or len(ids) >= self.context:
            size = "more characters than it can hold" if ids is None else f"{len(ids)} tokens"
            raise LmcliError(
                f"the prompt is {size}: no room for a reply in this model's context of {self.context} tokens"
            )
        dropped = starts[lo] - self.first
        self.first = starts[lo]
        return ids, dropped

    def save(self, path: str | Path) -> Path:
        """Write the conversation as ``{"messages": [...]}``, whole or not at all, to a new file
        or over a regular one (never over a device, a FIFO or a link)."""
        path = refuse_special(Path(path).expanduser())
        text = json.dumps({"messages": self.conversation()}, ensure_ascii=False, indent=2) + "\n"
        atomic_write(path, text)
        return path
