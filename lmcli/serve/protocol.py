"""OpenAI's request and response shapes: request bodies to a ``Job``, events to JSON.

Parameters: ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty`` and ``min_tokens`` (extensions, vLLM's names), ``stop``,
``seed``, ``n``, ``stream`` (with ``stream_options.include_usage``), ``logprobs`` (completions:
an integer 0-5; chat: true, with ``top_logprobs``), ``echo`` (completions), ``response_format``
(a JSON schema or any JSON object: a grammar's mask per row, ``generate/constrain.py``), and for
chat ``tools``/``tool_choice`` (``serve/tools.py``: shown by the template, calls read from the
reply, a required call constrained to its parameters' schema). The sampling values
are checked by ``SampleConfig``, the same declarations ``lmcli sample`` checks its flags with.
Unknown parameters are ignored.

Everything is checked against the model before a request is admitted, so that a request's error
stays its own: ``n`` within the batch, ``top_logprobs`` within the vocabulary, text that Unicode
can encode, the messages' roles (``chat_template.check_roles``, as ``lmcli chat``). A prompt of
more characters than the context can hold in tokens (``Model.max_chars``) is refused before it is
tokenized; the chat template renders through the server's ``Renderer`` (bounded time and
size). ``parse`` does all this work: the server calls it in a thread, off the event loop.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from lmcli.config.commands import SampleConfig
from lmcli.config.fields import SEED_MAX
from lmcli.errors import LmcliError
from lmcli.generate.constrain import Constraint, ConstraintError, Grammars
from lmcli.serve import tools as tool_calls
from lmcli.serve.scheduler import Job, TokenLogprob, Update
from lmcli.serve.tools import CallStream, ToolError, Tools
from lmcli.tasks import TextPrompt
from lmcli.text import chat_template
from lmcli.text.chat_template import Renderer, RendererClosed, RenderTooLong, Template, check_text
from lmcli.text.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5
MAX_STOPS = 16
# request field -> SampleConfig field
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
}


class ApiError(Exception):
    """An error response: HTTP status, OpenAI error type, message, and the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Model:
    """What the API needs of the served model."""

    name: str
    tokenizer: Tokenizer
    block_size: int
    template: Template | None  # a Hugging Face chat template, or None: lmcli's
    created: int
    form: TextPrompt = TextPrompt()  # how a prompt text is read (the task's, as `lmcli sample` reads it)
    no_chat: str | None = None  # why chat completions do not apply (a translation model), or None
    grammars: Grammars | None = None  # the compiler of response_format and tool_choice constraints

    @property
    def max_chars(self) -> int:
        """Characters a prompt may have: more cannot fit the context (``Tokenizer.longest_token``)."""
        return self.block_size * self.tokenizer.longest_token


@dataclass
class Request:
    """A parsed request: the job for the scheduler and how to answer."""

    kind: str  # "completion" or "chat"
    job: Job
    stream: bool
    include_usage: bool
    echo: list[str]  # completions with echo: each prompt's text, put before its choices' text
    id: str
    created: int
    tools: Tools | None = None  # chat: the request's tools (the reply is read for calls)


def _param(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool:
        raise ApiError(400, f"{name} must be {_kind_name(kind)}, got {value!r}", param=name)
    if not isinstance(value, kind):
        raise ApiError(400, f"{name} must be {_kind_name(kind)}, got {value!r}", param=name)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "text", list: "a list"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if set(kinds) == {int, float}:
        return "a number"
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _sample_config(body: dict[str, Any], n: int, max_tokens: int, seed: int) -> SampleConfig:
    """The request's sampling settings, each checked as ``lmcli sample`` checks its flag."""
    given: dict[str, Any] = {"max_new_tokens": max_tokens, "num_samples": n, "seed": seed}
    defaults = {"temperature": 1.0}  # OpenAI's default, where lmcli sample's is 0.8
    for api, field in SAMPLING.items():
        value = body.get(api, defaults.get(api))
        if value is None:
            continue
        if api == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise ApiError(400, "stop must be text or a list of text", param="stop")
            if len(value) > MAX_STOPS:
                raise ApiError(400, f"stop takes at most {MAX_STOPS} strings", param="stop")
            value = tuple(_text(s, "stop") for s in value)
        _checked(api, **{field: value})
        given[field] = value
    return _checked("request", **given)


def _checked(param: str, **fields: Any) -> SampleConfig:
    """``SampleConfig(**fields)``, its one-line error as a 400 naming ``param``."""
    try:
        return SampleConfig(**fields)
    except LmcliError as exc:
        raise ApiError(400, f"invalid {param}: {exc}", param=param) from None


def _text(text: str, param: str) -> str:
    try:
        return check_text(text, param)
    except LmcliError as exc:
        raise ApiError(400, str(exc), param=param) from None


def _common(
    body: dict[str, Any], prompt_len: int, model: Model, max_tokens_cap: int, default: int | None
) -> tuple[int, int, int]:
    """n, max_tokens and seed; max_tokens must fit the context after the longest prompt."""
    n = _param(body, "n", int, 1)
    room = model.block_size - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {model.block_size} tokens",
            param="messages" if default is None else "prompt",
            code="context_length_exceeded",
        )
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _param(body, name, int, None)
    if max_tokens is None:
        max_tokens = min(default if default is not None else room, room, max_tokens_cap)
    if max_tokens < 1:
        raise ApiError(400, f"{name} must be at least 1, got {max_tokens}", param=name)
    if prompt_len + max_tokens > model.block_size:
        raise ApiError(
            400,
            f"this model's context is {model.block_size} tokens; the prompt has {prompt_len} "
            f"and {name} asks for {max_tokens} more",
            param=name,
            code="context_length_exceeded",
        )
    if max_tokens > max_tokens_cap:
        raise ApiError(
            400, f"{name} is {max_tokens}; this server allows at most {max_tokens_cap}", param=name
        )
    seed = _param(body, "seed", int, None)
    if seed is None:
        seed = secrets.randbits(31)
    if not 0 <= seed <= SEED_MAX:
        raise ApiError(400, f"seed must be in [0, {SEED_MAX}], got {seed}", param="seed")
    return n, max_tokens, seed


def _prompts(body: dict[str, Any], model: Model) -> tuple[list[list[int]], list[str]]:
    """A completion's prompts (text, texts, token ids, or lists of ids) as ids; a text in the
    model's prompt form (``<bos>`` first where its tokenizer puts it), ids as given. A text
    longer than ``model.max_chars`` cannot fit: refused (a translation source is cut to it, as
    it would be cut to half the context) before it is tokenized."""
    prompt = body.get("prompt")
    tok = model.tokenizer
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt must be text, a list of texts, or token ids", param="prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    texts: list[str] = []
    ids: list[list[int] | None] = []
    for p in prompt:
        if isinstance(p, str):
            _text(p, "prompt")
            if len(p) > model.max_chars and model.form.shows_text:
                raise ApiError(
                    400,
                    f"the prompt has {len(p):,} characters: more than this model's context of "
                    f"{model.block_size} tokens can hold",
                    param="prompt",
                    code="context_length_exceeded",
                )
            texts.append(p)
            ids.append(None)  # tokenized below, all at once
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if len(p) > model.block_size:
                raise ApiError(
                    400,
                    f"the prompt has {len(p)} tokens; this model's context is {model.block_size} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
            if not all(0 <= t < tok.vocab_size for t in p):
                raise ApiError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")
            ids.append(list(p))
            texts.append(tok.decode(p))
        else:
            raise ApiError(400, "prompt must be text, a list of texts, or token ids", param="prompt")
    plain = [t[: model.max_chars] for t, i in zip(texts, ids, strict=True) if i is None]
    encoded = iter(tok.encode_batch(plain))  # releases the GIL: the event loop goes on
    framed = [model.form.frame(next(encoded), tok, model.block_size)[0] if i is None else i for i in ids]
    return framed, texts


def _chat_prompt(
    body: dict[str, Any], model: Model, renderer: Renderer | None, tools: Tools | None
) -> list[int]:
    """The chat messages' prompt: checked (the roles as ``lmcli chat`` checks them, and tool
    messages), the tools shown (``tools.for_template``), rendered within the renderer's bounds,
    refused before tokenizing when longer than the context holds."""
    if model.no_chat is not None:
        raise ApiError(400, model.no_chat)
    try:
        messages = chat_template.check_roles(chat_template.check_messages(body.get("messages")), tools=True)
        hf = model.template is not None
        messages = tool_calls.for_template(messages, tools, hf)
        extra = {"tools": list(tools.functions)} if tools is not None and hf else None
        return chat_template.encode(
            messages,
            model.template,
            model.tokenizer,
            renderer=renderer,
            extra=extra,
            max_chars=model.max_chars,
        )
    except RenderTooLong as exc:
        message = f"{exc}: more than this model's context of {model.block_size} tokens can hold"
        raise ApiError(400, message, param="messages", code="context_length_exceeded") from None
    except RendererClosed as exc:
        raise ApiError(503, str(exc), type="server_error", code="shutting_down") from None
    except LmcliError as exc:
        raise ApiError(400, str(exc), param="messages") from None


def parse(
    kind: str,
    body: Any,
    model: Model,
    *,
    max_tokens: int,
    max_batch: int,
    timeout: float,
    renderer: Renderer | None = None,
) -> Request:
    """A request body (parsed JSON) as a ``Request``, or an ``ApiError``; checked against the
    model before it is admitted (see the module docstring)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    stream = _param(body, "stream", bool, False)
    options = _param(body, "stream_options", dict, {})
    include_usage = bool(options.get("include_usage")) if stream else False
    n = _param(body, "n", int, 1)
    if not 1 <= n <= max_batch:
        raise ApiError(400, f"n must be between 1 and {max_batch} (this server's rows), got {n}", param="n")
    vocab = model.tokenizer.vocab_size
    echo: list[str] = []
    tools = None
    if kind == "chat":
        try:
            tools = tool_calls.parse_tools(body, model.template)
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        prompts = [_chat_prompt(body, model, renderer, tools)]
        default = None
        top: int | None = None
        if _param(body, "logprobs", bool, False):
            top = _param(body, "top_logprobs", int, 0)
            if not 0 <= top <= min(20, vocab):
                raise ApiError(
                    400, f"top_logprobs must be between 0 and {min(20, vocab)}", param="top_logprobs"
                )
    else:
        prompts, texts = _prompts(body, model)
        default = COMPLETION_DEFAULT_MAX_TOKENS
        top = _param(body, "logprobs", int, None)
        if top is not None and not 0 <= top <= min(MAX_LOGPROBS, vocab):
            raise ApiError(
                400, f"logprobs must be between 0 and {min(MAX_LOGPROBS, vocab)}", param="logprobs"
            )
        if _param(body, "echo", bool, False):
            echo = texts
    n, new, seed = _common(body, max(len(p) for p in prompts), model, max_tokens, default)
    cfg = _sample_config(body, n, new, seed)
    job = Job(prompts, cfg, top, timeout, processors=_processors(body, model, tools))
    if job.rows > max_batch:
        raise ApiError(
            400, f"this request needs {job.rows} rows (prompts x n); the server has {max_batch}", param="n"
        )
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    rid = prefix + secrets.token_hex(12)
    tools = tools if tools is not None and tools.parsed else None
    return Request(kind, job, stream, include_usage, echo, rid, int(time.time()), tools)


def _response_format(body: dict[str, Any]) -> Constraint | None:
    """``response_format``: ``text`` (none), ``json_object``, or ``json_schema`` (its ``schema``)."""
    rf = _param(body, "response_format", dict, None)
    if rf is None or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return Constraint("json_object")
    spec = rf.get("json_schema")
    if rf.get("type") != "json_schema" or not isinstance(spec, dict):
        raise ApiError(
            400,
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            param="response_format",
        )
    schema = spec.get("schema")
    if schema is None:
        raise ApiError(
            400,
            'response_format.json_schema has no "schema": give one, or {"type": "json_object"}',
            param="response_format",
        )
    if not isinstance(schema, dict):
        raise ApiError(
            400, "response_format.json_schema.schema must be a JSON object", param="response_format"
        )
    return Constraint.json_schema(schema)


def _processors(body: dict[str, Any], model: Model, tools: Tools | None) -> Any:
    """Each row's processors: the grammar of ``response_format`` or of a call the request
    requires (compiled now: a constraint that fails is this request's 400)."""
    constraint, param = _response_format(body), "response_format"
    try:
        required = tool_calls.constraint(tools) if tools is not None else None
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    if required is not None:
        if constraint is not None:
            raise ApiError(400, "response_format cannot be given with a required tool call", param=param)
        constraint, param = required, "tools"
    if constraint is None:
        return tuple
    if model.grammars is None:
        raise ApiError(400, "this server does not constrain replies", param=param)
    grammars = model.grammars
    try:
        grammars.compile(constraint)
    except ConstraintError as exc:
        raise ApiError(400, str(exc), param=param) from None
    return lambda: (grammars.processor(constraint),)


# ----------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens``: prompt tokens the prefix cache held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Choices:
    """The choices of a response as they grow: text, log-probs, finish reasons."""

    def __init__(self, req: Request, tokenizer: Tokenizer) -> None:
        self.req, self.tok = req, tokenizer
        n = req.job.cfg.num_samples
        self.count = req.job.rows
        # each choice's text as pieces (joined once: a long reply costs no copy per token)
        self.pieces = [[req.echo[i // n]] if req.echo else [] for i in range(self.count)]
        self.length = [len(p[0]) if p else 0 for p in self.pieces]  # characters so far
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(self.count)]
        self.finish: list[str | None] = [None] * self.count
        self.started = [False] * self.count
        tools = req.tools
        self.calls = [CallStream(tools.format) for _ in range(self.count)] if tools is not None else None

    def text(self, i: int) -> str:
        return "".join(self.pieces[i])

    def add(self, u: Update) -> None:
        if u.text:
            self.pieces[u.index].append(u.text)
            self.length[u.index] += len(u.text)
        self.logprobs[u.index] += u.logprobs
        if u.finish_reason is not None:
            self.finish[u.index] = u.finish_reason

    def _token(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False)

    def completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.req.job.top_logprobs is None:
            return None
        tokens = [self._token(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.job.top_logprobs is None:
            return None

        def item(t: int, lp: float) -> dict[str, Any]:
            s = self._token(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def response(self, model: str, done_usage: dict[str, Any]) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        req = self.req
        if req.kind == "chat":
            choices = []
            for i in range(self.count):
                message, reason = self._message(i), self.finish[i]
                if reason == "stop" and "tool_calls" in message:
                    reason = "tool_calls"
                logprobs = self.chat_logprobs(self.logprobs[i])
                choices.append(
                    {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}
                )
            obj = "chat.completion"
        else:
            n = req.job.cfg.num_samples
            choices = [
                {
                    "index": i,
                    "text": self.text(i),
                    "logprobs": self.completion_logprobs(
                        self.logprobs[i], len(req.echo[i // n]) if req.echo else 0
                    ),
                    "finish_reason": self.finish[i],
                }
                for i in range(self.count)
            ]
            obj = "text_completion"
        return {
            "id": req.id,
            "object": obj,
            "created": req.created,
            "model": model,
            "choices": choices,
            "usage": done_usage,
        }

    def _message(self, i: int) -> dict[str, Any]:
        """Choice ``i``'s message: its text, or, with tools, its content and calls."""
        if self.req.tools is None:
            return {"role": "assistant", "content": self.text(i)}
        content, calls = tool_calls.parse_reply(self.text(i), self.req.tools.format)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}
        return {"role": "assistant", "content": content or ""}

    def _finish(self, reason: str | None, i: int) -> str | None:
        """A streamed choice's finish reason: ``tool_calls`` once it has called a tool."""
        if reason == "stop" and self.calls is not None and self.calls[i].calls:
            return "tool_calls"
        return reason

    def _chat_delta(self, u: Update) -> dict[str, Any]:
        """A streamed update's delta: its text, or, with tools, its content and the calls that
        closed (each whole, as ``{"index", "id", "type", "function": {"name", "arguments"}}``)."""
        if self.calls is None:
            return {"content": u.text} if u.text or u.finish_reason is None else {}
        stream = self.calls[u.index]
        first = stream.calls
        content, calls = stream.feed(u.text)
        if u.finish_reason is not None:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": first + k, **c} for k, c in enumerate(calls)]
        return delta

    def chunk(self, model: str, u: Update | None = None, *, echo_index: int | None = None) -> dict[str, Any]:
        """One streamed chunk for update ``u`` (or, with ``echo_index``, that choice's echoed prompt)."""
        req = self.req
        if req.kind == "chat":
            assert u is not None
            delta = self._chat_delta(u)
            if not self.started[u.index]:
                delta = {"role": "assistant", "content": delta.get("content", "")} | delta
                self.started[u.index] = True
            choice = {
                "index": u.index,
                "delta": delta,
                "logprobs": self.chat_logprobs(u.logprobs),
                "finish_reason": self._finish(u.finish_reason, u.index),
            }
            obj = "chat.completion.chunk"
        else:
            if echo_index is not None:
                n = req.job.cfg.num_samples
                choice = {
                    "index": echo_index,
                    "text": req.echo[echo_index // n],
                    "logprobs": None,
                    "finish_reason": None,
                }
            else:
                assert u is not None
                offset = self.length[u.index] - len(u.text)
                choice = {
                    "index": u.index,
                    "text": u.text,
                    "logprobs": self.completion_logprobs(u.logprobs, offset),
                    "finish_reason": u.finish_reason,
                }
            obj = "text_completion"
        return {"id": req.id, "object": obj, "created": req.created, "model": model, "choices": [choice]}

    def usage_chunk(self, model: str, done_usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        return {
            "id": self.req.id,
            "object": obj,
            "created": self.req.created,
            "model": model,
            "choices": [],
            "usage": done_usage,
        }
