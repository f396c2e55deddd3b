"""Running the app: uvicorn on one socket, the scheduler thread, a graceful stop.

``serve`` blocks until SIGTERM or Ctrl-C, then stops accepting connections, lets in-flight
requests finish for ``cfg.grace`` seconds, cancels what is left, and returns (the command exits
0). ``running`` is the same server in a background thread, for tests and benchmarks.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from lmcli.checkpoint import Checkpoint
from lmcli.config import ServeConfig
from lmcli.errors import LmcliError
from lmcli.serve.app import create_app
from lmcli.serve.protocol import Model
from lmcli.serve.scheduler import Scheduler
from lmcli.tasks import make_task


def describe(ckpt: Checkpoint, cfg: ServeConfig) -> Model:
    """The served model as the API shows it."""
    from lmcli.chat_template import template_of

    name = cfg.model_name or (ckpt.path.parent.name if ckpt.path.name in ("best", "last") else ckpt.path.name)
    task = make_task(ckpt.train_config)
    no_chat = None if task.chat else task.refusal("use /v1/completions with the source as prompt")
    template = template_of(ckpt)
    block_size = ckpt.model.config.block_size
    return Model(name, ckpt.tokenizer, block_size, template, int(time.time()), task.prompt, no_chat)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one), or a one-line error."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise LmcliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """A uvicorn server that stops gracefully on a signal and does not re-raise it at the end
    (uvicorn would, and the process would exit with the signal's status instead of 0)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def _setup(ckpt: Checkpoint, cfg: ServeConfig, log_level: str) -> tuple[Any, Scheduler, socket.socket]:
    model = describe(ckpt, cfg)
    scheduler = Scheduler(
        ckpt.model,
        ckpt.tokenizer,
        max_batch=cfg.max_batch,
        max_queue=cfg.max_queue,
        threads=cfg.threads,
        prefix_lm=make_task(ckpt.train_config).prefix_lm,
    )
    app = create_app(model, scheduler, cfg)
    sock = bind(cfg.host, cfg.port)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=cfg.grace,
        access_log=False,
        lifespan="off",
        h11_max_incomplete_event_size=64 * 1024,
    )
    return _Server(config), scheduler, sock


def serve(ckpt: Checkpoint, cfg: ServeConfig, *, announce: Callable[[str], None] = print) -> None:
    """Serve ``ckpt`` until SIGTERM or Ctrl-C (see the module docstring)."""
    server, scheduler, sock = _setup(ckpt, cfg, "warning")
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    announce(f"lmcli serve: {describe(ckpt, cfg).name} on http://{shown}:{port} (chat page at /, API at /v1)")
    scheduler.start()
    try:
        server.run(sockets=[sock])
    finally:
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
        scheduler.close()
        sock.close()
