"""The process that renders Jinja chat templates for ``lmcli.text.template_render``.

A model folder's chat template is code someone else wrote: it runs here, in a process of its
own, started as ``python -I template_worker.py MEMORY`` with an empty environment. It imports
nothing of lmcli, only the standard library and jinja2; it caps its own address space at
``MEMORY`` bytes above what it holds at start (``RLIMIT_AS``: a template that builds a huge
string gets a ``MemoryError``); it renders in the sandboxed environment ``transformers``
renders chat templates in (``environment``), one chunk at a time, counting the characters; and
it exits when its parent goes. The parent bounds the time of each render (it kills the worker).

The protocol, one JSON line each way (UTF-8, lone surrogates passed through):

    in:   {"key": K, "template": TEXT or null (known by its key), "contexts": [C, ...], "max_chars": N}
    out:  one line per context: {"text": T}, or, ending the request, {"error": KIND, "message": M}

``KIND`` is ``template`` (the template raised an error: ``raise_exception``, a syntax error),
``failed`` (any other exception: a wrong type, a bad attribute, recursion), ``memory`` or
``size`` (more than ``max_chars`` characters).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from datetime import datetime
from typing import Any

READY = b'{"ready": true}\n'


def environment() -> Any:
    """The environment ``transformers`` renders chat templates in: sandboxed (no attribute of
    Python's internals, no mutation of the messages), ``tojson``, ``raise_exception``,
    ``strftime_now``, loop controls and the ``{% generation %}`` block (rendered as its body)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class TooLong(Exception):
    """The render passed its character limit."""


def render(template: Any, context: dict[str, Any], max_chars: int) -> str:
    """``template`` rendered with ``context``, chunk by chunk, at most ``max_chars`` characters."""
    parts, n = [], 0
    for chunk in template.generate(**context):
        n += len(chunk)
        if n > max_chars:
            raise TooLong
        parts.append(chunk)
    return "".join(parts)


def outcome(env: Any, templates: dict[str, Any], request: dict[str, Any]) -> list[dict[str, Any]]:
    """The answers to one request: a text per context, or the texts before the first error and it."""
    import jinja2

    out: list[dict[str, Any]] = []
    try:
        key = request["key"]
        if key not in templates:
            if len(templates) >= 8:
                templates.clear()
            templates[key] = env.from_string(request["template"])
        for context in request["contexts"]:
            out.append({"text": render(templates[key], context, request["max_chars"])})
    except TooLong:
        out.append({"error": "size", "message": ""})
    except MemoryError:
        out.append({"error": "memory", "message": ""})
    except jinja2.exceptions.TemplateError as exc:
        out.append({"error": "template", "message": str(exc)})
    except Exception as exc:  # the template's own bug: a wrong type, a bad attribute, recursion
        out.append({"error": "failed", "message": f"{type(exc).__name__}: {exc}"})
    return out


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _cap_memory(extra: int) -> None:
    """At most ``extra`` bytes of address space beyond what the process holds now."""
    size = _status("VmSize")
    if size and extra > 0:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _exit_with_parent() -> None:
    """End this process once its parent has gone (it would be adopted by another)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> None:
    env = environment()  # jinja2 imported before the memory cap
    _exit_with_parent()
    _cap_memory(int(argv[0]) if argv else 0)
    templates: dict[str, Any] = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(READY)
    stdout.flush()
    for line in stdin:
        request = json.loads(line.decode("utf-8", "surrogatepass"))
        for answer in outcome(env, templates, request):
            stdout.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
