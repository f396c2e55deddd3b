"""The process a ``--reward path/to/file.py:fn`` function runs in, apart from training.

``rewards.UserReward`` starts it (``python reward_worker.py``) and speaks to it over its standard
input and output: each message a pickle, prefixed by its length (8 bytes, little-endian). The
first request is (the file, the function's name, the training process's ``sys.path``): the file is
imported and the answer is ``("ok", None)`` or ``("error", what went wrong)``. Then each request
is one call, ``(prompt, reply, row)``, answered ``("ok", reward)`` or ``("error", why)``: the
function raised, returned no finite number, or called ``sys.exit``. A function that ends the
process itself (``os._exit``, a crash in native code) leaves its answer unwritten: the training
process reads the end of the pipe and says so in one line. Whatever the function prints goes to
standard error, never into the answers; Ctrl-C is the training process's to handle.

This file imports nothing but the standard library: starting it costs no import of lmcli or
torch.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
import signal
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next message, or None at the end of the stream (the other side is gone)."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    size = HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and message (at most 300 characters); ``sys.exit``
    said as such."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def load(path: Path, name: str) -> Callable[..., Any]:
    """Function ``name`` of the Python file ``path``, imported as a module of its own; a failure
    raises ``ValueError`` with the words that follow ``--reward SPEC:``."""
    module_name = f"lmcli_reward_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise ValueError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except BaseException as exc:  # the user's module failed to import (or exited): say where
        raise ValueError(f"importing {path} failed: {one_line(exc)}") from None
    sys.modules.setdefault(module_name, module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path} defines no function {name!r}")
    return fn


def call(fn: Callable[..., Any], prompt: str, reply: str, row: Any) -> tuple[str, Any]:
    """One reward: ``("ok", float)`` or ``("error", why)``."""
    try:
        value = fn(prompt, reply, row)
    except BaseException as exc:  # anything the user's code does, sys.exit included: one line
        return "error", one_line(exc)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "error", f"ValueError: returned {value!r}, not a finite number"
    return "ok", float(value)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which closes us
    answers, requests = os.fdopen(os.dup(1), "wb"), os.fdopen(os.dup(0), "rb")
    os.dup2(2, 1)  # what the function prints goes to stderr, never into the answers
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)  # and what it reads is nothing, never the requests
    os.close(nothing)
    first = receive(requests)
    if first is None:
        return
    path, name, search = first
    sys.path[:] = search
    try:
        fn = load(Path(path), name)
    except ValueError as exc:
        send(answers, ("error", str(exc)))
        return
    send(answers, ("ok", None))
    while (request := receive(requests)) is not None:
        send(answers, call(fn, *request))


if __name__ == "__main__":
    main()
