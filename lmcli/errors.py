"""The one exception type users see: printed as a single line, exit code 2."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable


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


Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape), as a file's header says


def check_tensors(
    expected: Header, found: Header, where: str, fit: str, expects: str, dtypes: Collection[str] = ()
) -> None:
    """One line when the tensors ``found`` in a file are not the ``expected`` ones: the names
    first ("WHERE do not fit FIT (missing ...)"), then each shape ("WHERE: NAME has shape S,
    EXPECTS S'"), then each dtype (the expected one, or any of ``dtypes`` when given)."""
    check_names(expected, found, f"{where} do not fit {fit}")
    for name, (dtype, shape) in expected.items():
        got_dtype, got_shape = found[name]
        if got_shape != shape:
            raise LmcliError(f"{where}: {name} has shape {got_shape}, {expects} {shape}")
        if got_dtype not in (dtypes or (dtype,)):
            wanted = f"one of {', '.join(dtypes)}" if dtypes else dtype
            raise LmcliError(f"{where}: {name} is {got_dtype}, expected {wanted}")


def check_blocks(
    names: Iterable[str], pattern: re.Pattern[str], n_layer: int, what: str, labels: tuple[str, str]
) -> None:
    """One line when the block numbers in tensor ``names`` (``pattern``'s first group) are not
    0 .. n_layer - 1, checked before anything as large as a config claims is built:
    "WHAT (LABEL0 n_layer, LABEL1: blocks found)"."""
    blocks = {int(m.group(1)) for name in names if (m := pattern.search(name))}
    if blocks != set(range(n_layer)):
        raise LmcliError(f"{what} ({labels[0]} {n_layer}, {labels[1]}: {len(blocks)})")
