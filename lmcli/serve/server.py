"""Running the app: uvicorn on one socket, the scheduler thread, a graceful stop.

``serve`` blocks until SIGTERM or Ctrl-C, then stops accepting connections, stops rendering
chat templates, lets in-flight requests finish for ``cfg.grace`` seconds, cancels what is left,
and returns (the command exits 0). ``running`` is the same server in a background thread, for
tests and benchmarks. Connections are held to ``cfg.max_connections`` and ``cfg.client_timeout``
by ``guard.Guard`` (uvicorn's h11 protocol, subclassed), swept twice a second; warnings of
uvicorn and of the guard are logged once per kind of event (``guard.EventLog``), and so is an
error of the event loop itself (``accept`` failing for lack of file descriptors).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from lmcli.config.commands import ServeConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import Checkpoint
from lmcli.generate.constrain import Grammars
from lmcli.generate.prefix_cache import PrefixCache
from lmcli.serve.app import create_app
from lmcli.serve.guard import ACCEPT_BURST, SWEEP_SECONDS, EventLog, Guard, guarded_protocol
from lmcli.serve.protocol import Model
from lmcli.serve.scheduler import Scheduler
from lmcli.tasks import make_task

BACKLOG = 2048  # connections the kernel holds until they are accepted


def describe(ckpt: Checkpoint, cfg: ServeConfig) -> Model:
    """The served model as the API shows it."""
    from lmcli.text.chat_template import template_of

    name = cfg.model_name or (ckpt.path.parent.name if ckpt.path.name in ("best", "last") else ckpt.path.name)
    task = make_task(ckpt.train_config)
    no_chat = None if task.chat else task.refusal("use /v1/completions with the source as prompt")
    template = template_of(ckpt)
    block_size = ckpt.model.config.block_size
    grammars = Grammars(ckpt.tokenizer)
    return Model(name, ckpt.tokenizer, block_size, template, int(time.time()), task.prompt, no_chat, grammars)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), or a one-line error."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise LmcliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """A uvicorn server that stops gracefully on a signal and does not re-raise it at the end
    (uvicorn would, and the process would exit with the signal's status instead of 0); that
    sweeps its connections (``Guard``) and logs once per event (``EventLog``); and that stops
    the app's work (``on_stop``: template rendering) as its shutdown begins."""

    def __init__(self, config: uvicorn.Config, guard: Guard, events: EventLog, on_stop: Callable[[], None]):
        super().__init__(config)
        self.guard, self.events, self.on_stop = guard, events, on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        await super().startup(sockets)  # asyncio accepts config.backlog (ACCEPT_BURST) a turn ...
        for sock in sockets or []:
            sock.listen(BACKLOG)  # ... and the kernel queues as many as before
        self._sweep(loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self.guard.sweep()
        self.events.flush()
        if not self.should_exit:
            loop.call_later(SWEEP_SECONDS, self._sweep, loop)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An error the event loop could not hand to anyone (e.g. ``accept`` out of file
        descriptors): one line, once per kind of event, no traceback."""
        exc = context.get("exception")
        detail = f": {exc}" if exc is not None else ""
        self.events.logger.error(f"{context.get('message', 'event loop error')}{detail}")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_stop()
        await super().shutdown(sockets)


def _event_log() -> EventLog:
    """The filter on uvicorn's logger that logs each event once (installed once per process)."""
    logger = logging.getLogger("uvicorn.error")
    for f in logger.filters:
        if isinstance(f, EventLog):
            return f
    events = EventLog(logger)
    logger.addFilter(events)
    return events


def _setup(
    ckpt: Checkpoint, cfg: ServeConfig, log_level: str, threads: int | None = None
) -> tuple[Any, Scheduler, socket.socket]:
    model = describe(ckpt, cfg)
    scheduler = Scheduler(
        ckpt.model,
        ckpt.tokenizer,
        max_batch=cfg.max_batch,
        max_queue=cfg.max_queue,
        threads=threads,
        prefix_lm=make_task(ckpt.train_config).prefix_lm,
        prefixes=PrefixCache(cfg.cache_memory) if cfg.cache_memory else None,
    )
    app = create_app(model, scheduler, cfg)
    sock = bind(cfg.host, cfg.port)
    events = _event_log()
    guard = Guard(cfg.max_connections, cfg.client_timeout, events.logger)
    config = uvicorn.Config(
        app,
        http=guarded_protocol(guard),
        log_level=log_level,
        timeout_graceful_shutdown=cfg.grace,
        timeout_keep_alive=min(5, cfg.client_timeout),
        backlog=ACCEPT_BURST,
        access_log=False,
        lifespan="off",
        h11_max_incomplete_event_size=64 * 1024,
    )
    return _Server(config, guard, events, app.state.api.close), scheduler, sock


def serve(
    ckpt: Checkpoint,
    cfg: ServeConfig,
    *,
    threads: int | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve ``ckpt`` until SIGTERM or Ctrl-C (see the module docstring); ``threads``: torch's
    CPU threads for decoding (default: all CPUs but one, which HTTP needs)."""
    server, scheduler, sock = _setup(ckpt, cfg, "warning", threads)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    announce(f"lmcli serve: {describe(ckpt, cfg).name} on http://{shown}:{port} (chat page at /, API at /v1)")
    scheduler.start()
    try:
        server.run(sockets=[sock])
    finally:
        server.on_stop()
        scheduler.close()
        sock.close()


@contextmanager
def running(
    ckpt: Checkpoint, cfg: ServeConfig, *, log_level: str = "error"
) -> Iterator[tuple[str, Scheduler]]:
    """The server in a background thread on ``cfg.host:cfg.port`` (0: a free port): its base URL
    and scheduler; stopped (gracefully, within ``cfg.grace``) when the block ends."""
    logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
    server, scheduler, sock = _setup(ckpt, cfg, log_level)
    host, port = sock.getsockname()[:2]
    scheduler.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}", scheduler
    finally:
        server.should_exit = True
        thread.join(cfg.grace + 10)
        server.on_stop()
        scheduler.close()
        sock.close()
