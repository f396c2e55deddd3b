"""Rendering a model folder's Jinja chat template with bounded work, out of the caller's process.

A chat template is code from the model folder. ``Renderer`` renders it in worker processes
(``lmcli.text.template_worker``: the sandboxed environment ``transformers`` uses, in a process with
an empty environment, its memory capped) and lets each render take at most
``RenderLimits.seconds`` of the worker's CPU time: a template that loops for hours, builds a
string of gigabytes or writes more than ``chars`` characters is refused in one line naming the
folder it came from, and the worker is replaced. The limit counts CPU time, not the wall clock,
so a machine loaded by other work (which gives the worker a share of a core) refuses no template
it would render when idle; ``RenderLimits.wall_seconds``, much larger, bounds a worker that gets
no CPU at all (and every render where the system does not say a process's CPU time). The wait
is a ``select`` on a pipe, so Ctrl-C and SIGTERM stop the caller at once (the worker, in a
session of its own, is killed with it), and a server's event loop never waits on a template: its
requests render in threads, each on a worker of its own.

``lmcli serve``, ``lmcli chat`` and ``train --task sft`` (``chat_template.encode`` and
``encode_conversation``) all render through one ``Renderer`` they own; the context may carry
extra variables (``tools``, ...) beside the messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import selectors
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError

WORKER = Path(__file__).with_name("template_worker.py")
START_SECONDS = 30.0  # a worker's start (python and jinja2 imported) on a loaded machine
TEMPLATE_LIMIT = 1 << 20  # characters of a template: real ones hold a few thousand


@dataclass(frozen=True)
class Template:
    """A Hugging Face chat template and where it came from (errors name it)."""

    text: str
    where: str = "the model folder"


@dataclass(frozen=True)
class RenderLimits:
    """The bounds of one render."""

    seconds: float = 2.0  # CPU time: a render that takes longer is refused (a real one: milliseconds)
    wall_seconds: float = 30.0  # the wall clock's backstop (a worker that gets no CPU time)
    chars: int = 8 << 20  # characters it may write
    memory: int = 512 << 20  # bytes of memory the worker may take beyond its start


class RendererClosed(LmcliError):
    """The renderer was closed (its owner stops): no more renders."""


class RenderTooLong(LmcliError):
    """The rendered text passed the caller's ``max_chars`` (e.g. more than a context can hold)."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


def as_template(template: Template | str | None) -> Template | None:
    """A ``Template`` (a bare string is one of unknown origin), None for lmcli's own."""
    if template is None or isinstance(template, Template):
        return template
    return Template(template, "the tokenizer")


class _Worker:
    """One worker process (started when first needed, killed when a render fails it)."""

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self.proc: subprocess.Popen[bytes] | None = None
        self.known: set[str] = set()  # template keys this process has compiled
        self.buffer = bytearray()

    def start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(WORKER), str(self.memory)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={},
                start_new_session=True,  # a Ctrl-C is the caller's to handle, not the worker's
            )
            self.known, self.buffer = set(), bytearray()
            if self.line(START_SECONDS) is None:
                self.kill()
                raise LmcliError("cannot start the chat template renderer (is jinja2 installed?)")
        return self.proc

    def line(self, seconds: float, wall_seconds: float | None = None) -> dict[str, Any] | None:
        """The worker's next answer, or None when it does not come within ``seconds`` of the
        worker's CPU time or ``wall_seconds`` (default: ``seconds``) of the wall clock (or the
        worker ended). A signal handler that raises (Ctrl-C) interrupts the wait."""
        assert self.proc is not None and self.proc.stdout is not None
        fd, pid = self.proc.stdout.fileno(), self.proc.pid
        start, cpu_start = time.monotonic(), cpu_seconds(pid)
        wall = seconds if wall_seconds is None else wall_seconds
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buffer:
                elapsed = time.monotonic() - start
                cpu = cpu_seconds(pid)
                used = cpu - cpu_start if cpu is not None and cpu_start is not None else elapsed
                if elapsed >= wall or used >= seconds:
                    return None
                # the CPU time grows no faster than the clock: look again when it could be spent
                if not sel.select(min(max(seconds - used, 0.05), wall - elapsed)):
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return None
                self.buffer += chunk
        end = self.buffer.index(b"\n")
        data = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return json.loads(data.decode("utf-8", "surrogatepass"))

    def kill(self) -> None:
        if self.proc is not None:
            _kill(self.proc)
            self.proc = None

    def stop(self) -> None:
        """Kill the process only: a render waiting on it sees its end (and cleans up)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user and system) process ``pid`` has used, from ``/proc``; None where the
    system does not say (then the wall clock stands in)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # after the name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
    proc.wait()


class Renderer:
    """Chat templates rendered in ``workers`` worker processes under ``limits`` (see the module
    docstring); thread-safe: each render takes a free worker, waiting for one if none is free."""

    def __init__(self, limits: RenderLimits | None = None, workers: int = 1) -> None:
        self.limits = limits or RenderLimits()
        self._all = [_Worker(self.limits.memory) for _ in range(workers)]
        self._free: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._all:
            self._free.put(w)
        self.closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._all)

    def __enter__(self) -> Renderer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker; renders in progress fail at once, later ones are refused."""
        self.closed = True
        for w in self._all:
            w.stop()
        free = []
        while not self._free.empty():  # the workers no render holds: cleaned up here
            free.append(self._free.get())
        for w in free:
            w.kill()
            self._free.put(w)

    def render(
        self, template: Template, contexts: list[dict[str, Any]], *, max_chars: int | None = None
    ) -> list[str]:
        """``template`` rendered with each of ``contexts`` (JSON values); one line naming
        ``template.where`` when a render fails or passes a limit; ``RenderTooLong`` when a text
        passes ``max_chars`` (below the limits' own ``chars``)."""
        if len(template.text) > TEMPLATE_LIMIT:
            raise LmcliError(
                f"the chat template of {template.where} is larger than {TEMPLATE_LIMIT >> 20} MiB: refused"
            )
        if not contexts:
            return []
        chars = min(self.limits.chars, max_chars) if max_chars is not None else self.limits.chars
        worker = self._free.get()
        try:
            return self._render(worker, template, contexts, chars)
        except BaseException as exc:
            if not isinstance(exc, LmcliError):  # interrupted: what it was doing is abandoned
                worker.kill()
            raise
        finally:
            self._free.put(worker)

    def _render(self, worker: _Worker, template: Template, contexts: list[dict], chars: int) -> list[str]:
        if self.closed:
            raise RendererClosed("chat templates are no longer rendered: shutting down")
        proc = worker.start()
        key = hashlib.sha256(template.text.encode("utf-8", "surrogatepass")).hexdigest()
        request = {
            "key": key,
            "template": None if key in worker.known else template.text,
            "contexts": contexts,
            "max_chars": chars,
        }
        data = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
        try:
            assert proc.stdin is not None
            proc.stdin.write(data)
            proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            worker.kill()
            raise self._stopped(template) from None
        worker.known.add(key)
        texts = []
        for _ in contexts:
            answer = worker.line(self.limits.seconds, self.limits.wall_seconds)
            if answer is None:
                worker.kill()  # still rendering, or dead: a fresh one next time
                raise self._stopped(template)
            if "error" in answer:
                raise self._failure(template, answer, chars)
            texts.append(answer["text"])
        return texts

    def _stopped(self, template: Template) -> LmcliError:
        """The worker gave no answer in time (or ended): the template is refused."""
        if self.closed:
            return RendererClosed("chat templates are no longer rendered: shutting down")
        return LmcliError(
            f"the chat template of {template.where} did not render within {self.limits.seconds:g} s "
            f"of CPU time (or {self.limits.wall_seconds:g} s in all): refused (a template that loops "
            "without end?)"
        )

    def _failure(self, template: Template, answer: dict[str, Any], chars: int) -> LmcliError:
        kind, message = answer["error"], answer.get("message", "")
        if kind == "template":
            return LmcliError(f"chat template: {message}")
        if kind == "failed":
            return LmcliError(f"chat template failed to render: {message}")
        if kind == "memory":
            return LmcliError(
                f"the chat template of {template.where} needed more than "
                f"{self.limits.memory >> 20} MiB of memory to render: refused"
            )
        if chars < self.limits.chars:
            return RenderTooLong(f"the rendered prompt is longer than {chars:,} characters", chars)
        return LmcliError(
            f"the chat template of {template.where} rendered more than {chars:,} characters: refused"
        )


def _close_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
