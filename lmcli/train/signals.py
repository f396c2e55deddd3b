"""Stopping a run cleanly: SIGINT/SIGTERM become a stop at the next step (agreed by every
rank), and the run's wall clock.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

from lmcli.errors import Terminated


class Clock:
    """Seconds of training: those of earlier sessions (a resumed run's) plus this one's."""

    def __init__(self, before: float) -> None:
        self.before, self.start = before, time.time()

    def __call__(self) -> float:
        return self.before + time.time() - self.start


SIGNALS = ("SIGINT", "SIGTERM")


@contextlib.contextmanager
def terminate_as_interrupt() -> Any:
    """SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``) in the block: opening a run (its
    data read, SFT conversations rendered) stops as on Ctrl-C, and the folder it made goes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise Terminated

    old = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint and stops at the next step. A second
    signal stops at once, except during a save: a save is never cut short (``saving``)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.in_save = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        elif not self.in_save:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def saving(self) -> Any:
        """A block (a save) that a second signal does not interrupt: the loop stops after it."""
        self.in_save = True
        try:
            yield
        finally:
            self.in_save = False

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
