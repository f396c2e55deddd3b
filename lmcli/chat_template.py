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
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.tokenizer import Tokenizer

Message = dict[str, str]  # {"role": ..., "content": ...}


def find_template(folder: str | Path) -> str | None:
    """The Hugging Face chat template stored in a model folder, or None."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


def _special(tokenizer: Tokenizer, token_id: int | None) -> str:
    return (tokenizer.hf.id_to_token(token_id) or "") if token_id is not None else ""


def _lmcli_parts(messages: list[Message], tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """lmcli's template of a prompt as (piece, is_special) pairs: the conversation, then the
    assistant's header."""
    sep = tokenizer.sep_id if tokenizer.sep_id is not None else tokenizer.eos_id
    parts = [(piece, special) for piece, special, _ in _lmcli_conversation(messages, tokenizer)]
    return parts + [("assistant", False), (_special(tokenizer, sep), True)]


def _generation_tag() -> Any:
    """Hugging Face's ``{% generation %}...{% endgeneration %}`` block, rendered as its body."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template compiled once (a conversation renders it once per reply when fine-tuning) in
    the environment ``transformers`` renders chat templates in: sandboxed, its helpers."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _render_jinja(
    template: str, messages: list[Message], tokenizer: Tokenizer, add_generation_prompt: bool = True
) -> str:
    """The Hugging Face template rendered as ``transformers``' ``apply_chat_template`` does."""
    import jinja2

    context = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": _special(tokenizer, tokenizer.bos_id),
        "eos_token": _special(tokenizer, tokenizer.eos_id),
        "pad_token": _special(tokenizer, tokenizer.pad_id),
        "unk_token": _special(tokenizer, tokenizer.unk_id),
    }
    try:
        return _compile(template).render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise LmcliError(f"chat template: {exc}") from None
    except Exception as exc:  # a template's own bug: a wrong type, a bad attribute, ...
        raise LmcliError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None


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
        out.append({"role": m["role"], "content": content})
    return out


def render(messages: list[Message], template: str | None, tokenizer: Tokenizer) -> str:
    """The prompt text for ``messages``, ending where the assistant's reply begins."""
    messages = check_messages(messages)
    if template is not None:
        return _render_jinja(template, messages, tokenizer)
    return "".join(piece for piece, _ in _lmcli_parts(messages, tokenizer))


def encode(messages: list[Message], template: str | None, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: special-token strings of the template become special ids.

    Under lmcli's template only the template's own special tokens do; under a Hugging Face
    template the whole rendered text is parsed for special tokens, as ``transformers`` does.
    """
    messages = check_messages(messages)
    if template is None:
        ids: list[int] = []
        for piece, special in _lmcli_parts(messages, tokenizer):
            ids += [tokenizer.hf.token_to_id(piece)] if special else tokenizer.encode(piece)
        return ids
    text = render(messages, template, tokenizer)
    return special_parser(tokenizer).encode(text, add_special_tokens=False).ids


def encode_conversation(
    messages: list[Message], template: str | None, tokenizer: Tokenizer
) -> tuple[list[int], list[bool]]:
    """A whole conversation's token ids and, per token, whether the loss reads it: the tokens of
    each assistant reply and its end token; system and user turns and the template's layout are
    context."""
    messages = check_messages(messages)
    if template is None:
        ids: list[int] = []
        scored: list[bool] = []
        for piece, special, reply in _lmcli_conversation(messages, tokenizer):
            piece_ids = [tokenizer.hf.token_to_id(piece)] if special else tokenizer.encode(piece)
            ids += piece_ids
            scored += [reply] * len(piece_ids)
        return ids, scored
    full = _render_jinja(template, messages, tokenizer, add_generation_prompt=False)
    spans = []  # (start, end) characters of each reply in the full text
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_jinja(template, messages[:k], tokenizer, add_generation_prompt=True)
        upto = _render_jinja(template, messages[: k + 1], tokenizer, add_generation_prompt=False)
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

    parser = HFTokenizer.from_str(tokenizer.to_json())
    parser.encode_special_tokens = False
    return parser
