"""Connections held to their bounds: slow, idle and too many clients cannot take the server.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive`` (5 s), but a
connection that never sends a whole request, sends its body a byte a minute, or never reads
its answer stays open for ever; and past the open-file limit (``ulimit -n``) ``accept`` fails
and nobody else gets in. ``guarded_protocol`` gives uvicorn a subclass of its own h11 protocol
that reports every connection to a ``Guard``:

- a connection has ``client_timeout`` seconds to send a request's headers (from its opening or
  the end of its previous answer), the same again for the body, and the same to take a
  stalled answer (while writing is paused for it); past that it is closed;
- at most ``max_connections`` are open (fewer when the open-file limit leaves less room, with
  ``RESERVED_FDS`` kept for the server's own files); a new connection past the cap closes the
  one that has waited longest without a request in progress (a request being answered is never
  closed), or, when every one has a request in progress, gets a 503 and is closed. The event
  loop accepts at most ``ACCEPT_BURST`` connections a turn (the guard sees each in the next),
  while the kernel's queue of connections waiting to be accepted stays long.

``EventLog`` logs each kind of event once, then at most once a minute with a count: a flood of
clients makes a few lines, not one per connection (it filters uvicorn's own warnings too).
The protocol is a subclass rather than an ASGI middleware because a middleware sees a request
only once its headers are in, and never a connection that sends nothing; ``limit_concurrency``
answers 503 but keeps every idle connection open.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmcli.serve.scheduler import malloc_trim

RESERVED_FDS = 128  # file descriptors kept for the server's own files beside its connections
ACCEPT_BURST = 32  # connections accepted in one turn of the event loop before the guard sees them
TRIM_AT = 64  # once this many connections have gone, the allocator's free pages go back
SWEEP_SECONDS = 0.5
_BODY = (
    b'{"error": {"message": "too many connections", "type": "server_error", "param": null, '
    b'"code": "overloaded"}}'
)
REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class EventLog(logging.Filter):
    """A filter that lets each message through once per ``every`` seconds and counts the rest;
    ``flush`` logs the counts of messages held back for ``every`` seconds."""

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        super().__init__()
        self.logger, self.every = logger, every
        self.seen: dict[str, tuple[float, int]] = {}  # message -> (when last let through, held since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "summary", False):
            return True
        key, now = str(record.msg), time.monotonic()
        last, held = self.seen.get(key, (-self.every, 0))
        if now - last < self.every:
            self.seen[key] = (last, held + 1)
            return False
        self.seen[key] = (now, 0)
        return True

    def flush(self) -> None:
        now = time.monotonic()
        for key, (last, held) in list(self.seen.items()):
            if held and now - last >= self.every:
                self.seen[key] = (now, 0)
                line = f"{key.strip()} (again {held} time(s) in the last {self.every:g} s)"
                self.logger.warning(line, extra={"summary": True})


def connection_cap(wanted: int) -> int:
    """``wanted``, or fewer when the open-file limit leaves less room beside the files open now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 32
    return max(1, min(wanted, soft - open_now - RESERVED_FDS))


class Guard:
    """Every open connection, its phase and since when; the cap and the timeouts (see the module
    docstring). Runs on the event loop: no locks."""

    def __init__(self, max_connections: int, client_timeout: float, log: logging.Logger) -> None:
        self.cap = connection_cap(max_connections)
        self.timeout, self.log = client_timeout, log
        self.conns: dict[Any, tuple[str, float]] = {}  # protocol -> (phase, since)
        self.high = 0  # the most connections open since memory was last given back
        self.trim = malloc_trim()
        if self.cap < max_connections:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            log.warning(f"the open-file limit (ulimit -n {soft}) allows {self.cap} connections at once")

    def opened(self, proto: Any) -> bool:
        """A new connection: registered, or (False) refused when the cap is reached and every
        connection has a request in progress."""
        if len(self.conns) >= self.cap:
            waiting = [(since, p) for p, (phase, since) in self.conns.items() if phase != "busy"]
            if not waiting:
                self.log.warning(f"{self.cap} connections, each with a request in progress: new ones get 503")
                proto.transport.write(REFUSED)
                proto.transport.close()
                return False
            self.log.warning(
                f"connection limit of {self.cap} reached: closing those waiting longest for a request"
            )
            self._close(min(waiting, key=lambda w: w[0])[1])
        self.conns[proto] = ("headers", time.monotonic())
        self.high = max(self.high, len(self.conns))
        return True

    def closed(self, proto: Any) -> None:
        self.conns.pop(proto, None)

    def touched(self, proto: Any) -> None:
        """The connection received bytes or finished an answer: its phase may have changed."""
        if proto in self.conns:
            phase = _phase(proto)
            if phase != self.conns[proto][0]:
                self.conns[proto] = (phase, time.monotonic())

    def sweep(self) -> None:
        """Close the connections past their time in their phase; once most of a crowd of
        connections has gone, give their buffers' memory back to the system."""
        if self.high - len(self.conns) >= TRIM_AT and len(self.conns) <= self.high // 4:
            self.trim()
            self.high = len(self.conns)
        now = time.monotonic()
        for proto, (phase, since) in list(self.conns.items()):
            current = _phase(proto)
            if current != phase:
                self.conns[proto] = (current, now)
            elif phase != "busy" and now - since > self.timeout:
                what = {
                    "headers": "send a request's headers",
                    "body": "send a body",
                    "stalled": "read an answer",
                }[phase]
                self.log.warning(f"closed connections that took more than {self.timeout:g} s to {what}")
                self._close(proto)

    def _close(self, proto: Any) -> None:
        self.conns.pop(proto, None)
        if not proto.transport.is_closing():
            proto.transport.close()


def _phase(proto: Any) -> str:
    """``headers`` (waiting for a request), ``body`` (reading one), ``stalled`` (its answer
    waits for the client to read), else ``busy`` (a request in progress)."""
    state = proto.conn.their_state
    if state is h11.IDLE:
        return "headers"
    if state is h11.SEND_BODY:
        return "body"
    flow = getattr(proto, "flow", None)
    return "stalled" if flow is not None and flow.write_paused else "busy"


def guarded_protocol(guard: Guard) -> type[H11Protocol]:
    """uvicorn's h11 protocol reporting each connection to ``guard``."""

    class Guarded(H11Protocol):
        watcher: ClassVar[Guard] = guard

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not self.watcher.opened(self):
                self.connections.discard(self)

        def connection_lost(self, exc: Exception | None) -> None:
            self.watcher.closed(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self.watcher.touched(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.watcher.touched(self)

    return Guarded
