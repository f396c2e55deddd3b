"""``python -m lmcli.eval.harness ARGS``: the ``lm_eval`` command with ``--model lmcli`` known."""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

import lmcli.eval.harness  # noqa: F401 - registers the lmcli model
from lmcli.errors import LmcliError


def main() -> None:
    """``lm_eval``'s command line; lmcli's own errors (a bad run folder, model_args) are one line
    and exit code 2."""
    try:
        cli_evaluate()
    except LmcliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
