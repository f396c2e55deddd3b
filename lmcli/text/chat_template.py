"""Chat messages to a prompt: the model's own Hugging Face chat template, or lmcli's.

A model folder whose tokenizer carries a Hugging Face ``chat_template`` (Jinja, in
``tokenizer_config.json`` or ``chat_template.jinja``) is rendered as ``transformers`` renders it:
a sandboxed Jinja environment, ``add_generation_prompt=True``, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) in the context. Any other model uses lmcli's template, built
from lmcli's special tokens:

    <bos>system<sep>You are terse.<eos>user<sep>Hi!<eos>assistant<sep>

each message as ``ROLE <sep> CONTENT <eos>``, then ``assistant <sep>``: the reply is what the
model writes until its ``<eos>``. ``encode`` turns the rendered prompt into token ids: the
template's special tokens become the special ids, while the same strings typed in a message stay
plain text under lmcli's template.

``encode_conversation`` renders a whole conversation for fine-tuning and marks the tokens the
loss reads: each assistant reply and its end token. Under lmcli's template these are the reply's
``CONTENT <eos>``; under a Hugging Face template the conversation is rendered prefix by prefix:
a reply is the text that rendering it adds to the conversation before it (rendered with the
generation prompt), its trailing whitespace left out, so the template's own end-of-turn token
belongs to the reply and the layout between turns does not.

A Hugging Face template is code from the model folder: it renders through a
``template_render.Renderer`` (a worker process, bounded time, memory and output; a template
past them is refused in one line naming its folder). A caller that renders often (the server, a
chat session, SFT data) owns one ``Renderer`` and passes it; without one, each call starts one.
The messages are checked first: text content only (no lone surrogates), and ``check_roles``
is the one rule of roles that ``lmcli chat`` and the server share.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.safe_io import check_text
from lmcli.text.sentencepiece import SentencePiece
from lmcli.text.template_render import (
    TEMPLATE_LIMIT,
    Renderer,
    RendererClosed,
    RenderTooLong,
    Template,
    as_template,
)
from lmcli.text.tokenizer import CONFIG_LIMIT, Tokenizer

Message = dict[str, Any]  # {"role": ..., "content": ...} (and a tool call's fields: _tool_fields)
ROLES = ("system", "user", "assistant")

__all__ = [
    "Renderer",
    "RendererClosed",
    "RenderTooLong",
    "Template",
    "check_messages",
    "check_roles",
    "encode",
]


def find_template(folder: str | Path) -> Template | None:
    """The Hugging Face chat template stored in a model folder, or None."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        if jinja.stat().st_size > 4 * TEMPLATE_LIMIT:
            raise LmcliError(f"{jinja} is larger than {TEMPLATE_LIMIT >> 20} MiB: not a chat template")
        return Template(jinja.read_text(encoding="utf-8", errors="replace"), str(folder))
    config = folder / "tokenizer_config.json"
    if not config.is_file() or config.stat().st_size > CONFIG_LIMIT:
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return Template(template, str(folder)) if isinstance(template, str) and template.strip() else None


def template_of(ckpt: Any) -> Template | str | None:
    """The chat template of a loaded model: its folder's, else its tokenizer's (a GGUF file
    holds it in its metadata), or None: lmcli's."""
    return find_template(ckpt.path) or ckpt.tokenizer.chat_template


def _special(tokenizer: Tokenizer, token_id: int | None) -> str:
    return (tokenizer.hf.id_to_token(token_id) or "") if token_id is not None else ""


def _lmcli_parts(messages: list[Message], tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """lmcli's template of a prompt as (piece, is_special) pairs: the conversation, then the
    assistant's header."""
    sep = tokenizer.sep_id if tokenizer.sep_id is not None else tokenizer.eos_id
    parts = [(piece, special) for piece, special, _ in _lmcli_conversation(messages, tokenizer)]
    return parts + [("assistant", False), (_special(tokenizer, sep), True)]


def _context(
    messages: list[Message],
    tokenizer: Tokenizer,
    add_generation_prompt: bool,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a Hugging Face template sees, as ``transformers``' ``apply_chat_template`` gives it;
    ``extra``: more variables (e.g. ``tools``), JSON values."""
    return {
        **(extra or {}),
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": _special(tokenizer, tokenizer.bos_id),
        "eos_token": _special(tokenizer, tokenizer.eos_id),
        "pad_token": _special(tokenizer, tokenizer.pad_id),
        "unk_token": _special(tokenizer, tokenizer.unk_id),
    }


def _render_jinja(
    template: Template,
    contexts: list[dict[str, Any]],
    renderer: Renderer | None,
    max_chars: int | None = None,
) -> list[str]:
    """``template`` rendered with each context, by ``renderer`` (or one started for the call)."""
    if renderer is not None:
        return renderer.render(template, contexts, max_chars=max_chars)
    with Renderer() as own:
        return own.render(template, contexts, max_chars=max_chars)


def check_messages(messages: Any) -> list[Message]:
    """``messages`` as a list of {"role", "content"} with text content, or a one-line error.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined).
    """
    if not isinstance(messages, list) or not messages:
        raise LmcliError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LmcliError(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise LmcliError(f"messages[{i}]: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise LmcliError(f"messages[{i}].content must be text")
        check_text(m["role"], f"messages[{i}].role")
        message = {"role": m["role"], "content": check_text(content, f"messages[{i}].content")}
        out.append(message | _tool_fields(m, i))
    return out


def _tool_fields(m: dict[str, Any], i: int) -> dict[str, Any]:
    """A message's tool fields, checked: an assistant's ``tool_calls`` (functions, each with a
    name and its arguments as JSON text or an object), a tool message's ``tool_call_id``/``name``."""
    out: dict[str, Any] = {}
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise LmcliError(f"messages[{i}].{key} must be text")
            out[key] = check_text(m[key], f"messages[{i}].{key}")
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise LmcliError(f"messages[{i}].tool_calls must be a list, in an assistant message")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise LmcliError(f"messages[{i}].tool_calls[{j}] must be a function call with a name")
        if not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise LmcliError(f"messages[{i}].tool_calls[{j}].function.arguments must be JSON text")
    out["tool_calls"] = calls
    return out


def check_roles(messages: list[Message], tools: bool = False) -> list[Message]:
    """``messages`` whose roles are system (first only), user or assistant, ending with the
    user's: the rule of ``lmcli chat`` and of the server's chat completions alike. ``tools``
    (the server): ``tool`` messages too (a call's result), and the last may be one."""
    roles = (*ROLES, "tool") if tools else ROLES
    for i, m in enumerate(messages):
        if m["role"] not in roles:
            raise LmcliError(f"messages[{i}].role must be one of {', '.join(roles)}, got {m['role']!r}")
        if m["role"] == "system" and i > 0:
            raise LmcliError(f"messages[{i}]: a system message may only come first")
    if messages[-1]["role"] not in (("user", "tool") if tools else ("user",)):
        raise LmcliError("the last message must be the user's: it is the one the reply answers")
    return messages


def render(
    messages: list[Message],
    template: Template | str | None,
    tokenizer: Tokenizer,
    *,
    renderer: Renderer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages``, ending where the assistant's reply begins."""
    messages = check_messages(messages)
    template = as_template(template)
    if template is not None:
        return _render_jinja(template, [_context(messages, tokenizer, True, extra)], renderer)[0]
    return "".join(piece for piece, _ in _lmcli_parts(messages, tokenizer))


def encode(
    messages: list[Message],
    template: Template | str | None,
    tokenizer: Tokenizer,
    *,
    renderer: Renderer | None = None,
    extra: Mapping[str, Any] | None = None,
    max_chars: int | None = None,
) -> list[int]:
    """The prompt's token ids: special-token strings of the template become special ids.

    Under lmcli's template only the template's own special tokens do; under a Hugging Face
    template the whole rendered text is parsed for special tokens, as ``transformers`` does.
    ``max_chars``: a prompt of more characters is refused (``RenderTooLong``) before it is
    tokenized. Tokenizing releases the GIL (a server's event loop goes on meanwhile).
    """
    messages = check_messages(messages)
    template = as_template(template)
    if template is None:
        parts = _lmcli_parts(messages, tokenizer)
        chars = sum(len(piece) for piece, _ in parts)
        if max_chars is not None and chars > max_chars:
            raise RenderTooLong(f"the prompt is {chars:,} characters, more than {max_chars:,}", max_chars)
        texts = iter(tokenizer.encode_batch([piece for piece, special in parts if not special]))
        ids: list[int] = []
        for piece, special in parts:
            ids += [tokenizer.hf.token_to_id(piece)] if special else next(texts)
        return ids
    context = _context(messages, tokenizer, True, extra)
    text = _render_jinja(template, [context], renderer, max_chars)[0]
    return special_parser(tokenizer).encode_batch([text], add_special_tokens=False)[0].ids


def encode_conversation(
    messages: list[Message],
    template: Template | str | None,
    tokenizer: Tokenizer,
    *,
    renderer: Renderer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[list[int], list[bool]]:
    """A whole conversation's token ids and, per token, whether the loss reads it: the tokens of
    each assistant reply and its end token; system and user turns and the template's layout are
    context. ``extra``: more variables for a Hugging Face template (e.g. ``tools``)."""
    messages = check_messages(messages)
    template = as_template(template)
    if template is None:
        ids: list[int] = []
        scored: list[bool] = []
        for piece, special, reply in _lmcli_conversation(messages, tokenizer):
            piece_ids = [tokenizer.hf.token_to_id(piece)] if special else tokenizer.encode(piece)
            ids += piece_ids
            scored += [reply] * len(piece_ids)
        return ids, scored
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    contexts = [_context(messages, tokenizer, False, extra)]  # the whole, then per reply: before, up to it
    for k in replies:
        before, upto = messages[:k], messages[: k + 1]
        contexts += [_context(before, tokenizer, True, extra), _context(upto, tokenizer, False, extra)]
    full, *prefixes = _render_jinja(template, contexts, renderer)
    spans = []  # (start, end) characters of each reply in the full text
    for k, before, upto in zip(replies, prefixes[::2], prefixes[1::2], strict=True):
        if not (full.startswith(upto) and upto.startswith(before)):
            raise LmcliError(
                f"chat template: rendering the conversation up to message {k} is not a prefix of "
                "rendering all of it, so the reply's tokens cannot be found"
            )
        spans.append((len(before), len(upto.rstrip())))
    enc = special_parser(tokenizer).encode(full, add_special_tokens=False)
    scored = [any(a <= start < b for a, b in spans) for start, _ in enc.offsets]
    return list(enc.ids), scored


def _lmcli_conversation(messages: list[Message], tokenizer: Tokenizer) -> list[tuple[str, bool, bool]]:
    """lmcli's template of a whole conversation as (piece, is_special, is_reply) triples."""
    sep = tokenizer.sep_id if tokenizer.sep_id is not None else tokenizer.eos_id
    parts = [(_special(tokenizer, tokenizer.bos_id), True, False)]
    for m in messages:
        reply = m["role"] == "assistant"
        parts += [(m["role"], False, False), (_special(tokenizer, sep), True, False)]
        parts += [(m["content"], False, reply), (_special(tokenizer, tokenizer.eos_id), True, reply)]
    return parts


@functools.lru_cache(maxsize=4)
def special_parser(tokenizer: Tokenizer) -> Any:
    """A copy of the tokenizer that reads special-token strings as special tokens."""
    from tokenizers import Tokenizer as HFTokenizer

    if isinstance(tokenizer.hf, SentencePiece):  # its tables shared, not built again
        parser = tokenizer.hf.copy()
    else:
        parser = HFTokenizer.from_str(tokenizer.to_json())
    parser.encode_special_tokens = False
    return parser
