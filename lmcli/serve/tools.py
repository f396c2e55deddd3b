"""Tool calling in chat completions: ``tools`` and ``tool_choice`` checked, the tools shown to the
model, its reply parsed into ``tool_calls`` (whole, or as it streams), and the conversation's
tool messages made ready for the chat template.

How a model calls a tool is its chat template's convention, chosen once from the template
(``call_format``):

- ``hermes`` (Qwen2.5, Hermes, and lmcli's own template): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, any number of them, text around them is content;
- ``json`` (Llama 3.1/3.2): the whole reply is one ``{"name": ..., "parameters": {...}}``.

A Hugging Face template gets the tools as its ``tools`` variable, as ``transformers``'
``apply_chat_template(tools=...)`` gives them; lmcli's template shows them in the system message
(``system_text``: the text an SFT conversation puts there to teach a model its tools). With
``tool_choice`` ``required`` or a named function, the reply is constrained (``constraint``) to one
call whose arguments follow the tool's ``parameters`` schema; with ``auto`` the model chooses, and
a reply that is not a well-formed call is content; with ``none`` nothing is parsed.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from lmcli.generate.constrain import JSON_OPTIONS, Constraint
from lmcli.generate.schemas import no_finite_value
from lmcli.text.template_render import Template

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolError(ValueError):
    """A ``tools`` or ``tool_choice`` the server refuses (400): the message and the parameter."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools: the functions (OpenAI's ``{"type": "function", "function": {...}}``),
    the choice (``auto``, ``none``, ``required`` or a function's name) and the call format."""

    functions: tuple[dict[str, Any], ...]
    choice: str
    format: str  # "hermes" or "json"

    @property
    def parsed(self) -> bool:
        """Whether the reply is read for tool calls."""
        return self.choice != "none"

    def names(self) -> list[str]:
        return [f["function"]["name"] for f in self.functions]


def call_format(template: Template | None) -> str:
    """``hermes`` unless the model's template writes calls as bare JSON with ``parameters``."""
    text = template.text if template is not None else ""
    return "json" if OPEN not in text and "parameters" in text and "tool" in text else "hermes"


def parse_tools(body: dict[str, Any], template: Template | None) -> Tools | None:
    """The request's ``tools`` and ``tool_choice``, checked, or None when it has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ToolError("tools: two functions have the same name", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or name not in names:
            raise ToolError(f"tool_choice names no function of tools ({', '.join(names)})", "tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ToolError('tool_choice must be "auto", "none", "required" or a function', "tool_choice")
    return Tools(functions, choice, call_format(template))


def _function(tool: Any, i: int) -> dict[str, Any]:
    """One tool, checked: a function with a name and an object schema of parameters."""
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function":
        raise ToolError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ . or -", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must be a JSON schema of an object", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"{where}.function.description must be text", "tools")
    return {"type": "function", "function": {**fn, "parameters": params}}


def constraint(tools: Tools) -> Constraint | None:
    """The grammar of a reply that must call a tool (``required``: any, or the named one): one
    call, its arguments valid against the function's parameters; None when the model chooses."""
    if tools.choice in ("auto", "none"):
        return None
    key = "arguments" if tools.format == "hermes" else "parameters"
    options = {
        i: {
            "type": "object",
            "properties": {"name": {"const": f["function"]["name"]}, key: f["function"]["parameters"]},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for i, f in enumerate(tools.functions)
        if tools.choice == "required" or f["function"]["name"] == tools.choice
    }
    root: dict[str, Any] = {"anyOf": list(options.values()), "x-guidance": JSON_OPTIONS}
    for f in tools.functions:  # "#/$defs/..." references resolve against the root: the defs go there
        for defs in ("$defs", "definitions"):
            for name, definition in f["function"]["parameters"].get(defs, {}).items():
                if root.setdefault(defs, {}).setdefault(name, definition) != definition:
                    raise ToolError(f"tools: two functions define {defs}/{name} differently", "tools")
    for i, option in options.items():  # a call that cannot be written fails before admission
        reason = no_finite_value(option, root)
        if reason is not None:
            raise ToolError(f"tools[{i}].function.parameters: {reason}", "tools")
    schema = json.dumps(root)
    call = f"call: %json {schema}"
    if tools.format == "hermes":
        return Constraint("grammar", f'start: "{OPEN}\\n" call "\\n{CLOSE}"\n{call}')
    return Constraint("grammar", f"start: call\n{call}")


def system_text(functions: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str:
    """How lmcli's own template shows the tools: at the end of the system message."""
    lines = "\n".join(json.dumps(f["function"], ensure_ascii=False) for f in functions)
    return (
        f"# Tools\n<tools>\n{lines}\n</tools>\nTo call a function, reply "
        f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def call_text(name: str, arguments: Any, fmt: str = "hermes") -> str:
    """A call as the model writes it (what an SFT reply holds, what the grammar allows)."""
    if fmt == "json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def for_template(messages: list[dict[str, Any]], tools: Tools | None, hf: bool) -> list[dict[str, Any]]:
    """The messages as the template reads them: assistant ``tool_calls`` with arguments as
    objects (Hugging Face templates ``tojson`` them); under lmcli's template, the calls written
    into the content and the tools in the system message."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            calls = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in calls
            ]
            m = {**m, "tool_calls": calls}
            if not hf:
                text = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
                m = {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text}
        elif not hf:
            m = {"role": m["role"], "content": m["content"]}
        out.append(m)
    if not hf and tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system_text(tools.functions)}
        else:
            out.insert(0, {"role": "system", "content": system_text(tools.functions)})
    return out


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


# ----------------------------------------------------------------------------- the reply


def parse_reply(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The whole reply's content (None if nothing but calls) and its calls in OpenAI's shape,
    read as ``CallStream`` reads it streamed: a call that is not well-formed is content."""
    stream = CallStream(fmt)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content = (content + rest).strip()
    return content or None, calls + more


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_call(text: str) -> dict[str, Any] | None:
    body = text.strip().removeprefix("<|python_tag|>")
    return _call(_loads(body), "parameters") if body.startswith("{") else None


def _call(obj: Any, key: str) -> dict[str, Any] | None:
    """A parsed call ``{"name": ..., key: {...}}`` in OpenAI's shape (arguments as JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


class CallStream:
    """One choice's reply as it streams: ``feed`` returns the content to show and the calls
    complete so far, ``finish`` the rest. Content that might begin a call is held back; a call
    is sent whole once it has closed (OpenAI's deltas allow a call in one piece)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.pending = ""  # text not yet sent: a call, or what might begin one
        self.calls = 0  # calls sent
        self.whole: bool | None = None if fmt == "json" else False  # json: is the reply one call?

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        if self.fmt == "json":
            if self.whole is None and self.pending.strip():
                body = self.pending.lstrip()
                self.whole = body.startswith("{") or "<|python_tag|>".startswith(body[:14])
            if self.whole:
                return "", []
            out, self.pending = self.pending, ""
            return out, []
        return self._hermes()

    def _hermes(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = _held(self.pending, OPEN)
                content += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                return content, calls
            end = self.pending.find(CLOSE, start)
            if end < 0:
                content += self.pending[:start]
                self.pending = self.pending[start:]
                return content, calls
            call = _call(_loads(self.pending[start + len(OPEN) : end].strip()), "arguments")
            piece = self.pending[start : end + len(CLOSE)]
            if call is None:
                content += self.pending[: end + len(CLOSE)]
            else:
                content += self.pending[:start]
                calls.append(call)
                self.calls += 1
            self.pending = self.pending[start + len(piece) :]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: an unclosed call is parsed as a call if it is one."""
        rest, self.pending = self.pending, ""
        if self.fmt == "json":
            call = _json_call(rest) if self.whole else None
            if call is None:
                return rest, []
            self.calls += 1
            return "", [call]
        if rest.startswith(OPEN):
            call = _call(_loads(rest[len(OPEN) :].strip()), "arguments")
            if call is not None:
                self.calls += 1
                return "", [call]
        return rest, []


def _held(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that might begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
