"""The one exception type users see: printed as a single line, exit code 2."""

from __future__ import annotations

from collections.abc import Iterable


class LmcliError(Exception):
    """A user-facing error: bad input, bad option values, unreadable files.

    The CLI prints ``error: <message>`` to stderr and exits with code 2, never a traceback.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a command stops as on Ctrl-C (the CLI exits with code 143)."""


def check_names(expected: Iterable[str], found: Iterable[str], what: str) -> None:
    """One line when ``found`` (tensor names in a file) is not ``expected``: ``what`` (e.g.
    "weights PATH do not fit the model config") and the first few missing and unexpected."""
    expected, found = set(expected), set(found)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        lists = f"missing: {', '.join(missing[:3]) or '-'}; unexpected: {', '.join(unexpected[:3]) or '-'}"
        raise LmcliError(f"{what} ({lists})")
