"""``python -m lmcli.model.native build [--sanitize]``: compile the kernels into the cache and say
which path products take; ``python -m lmcli.model.native`` only says it."""

from __future__ import annotations

import sys

from lmcli.errors import LmcliError
from lmcli.model.native import build, ops


def main(argv: list[str]) -> int:
    if argv[:1] not in ([], ["build"]) or any(a not in ("build", "--sanitize") for a in argv):
        print("usage: python -m lmcli.model.native [build [--sanitize]]", file=sys.stderr)
        return 2
    if argv[:1] == ["build"]:
        try:
            path = build.build(sanitize="--sanitize" in argv)
        except LmcliError as e:
            if "--sanitize" in argv:  # make check-native: a failure
                print(f"error: {e}", file=sys.stderr)
                return 2
            # make install goes on: products then take torch's path, as backend_line says
            print(f"warning: {e}; lmcli uses torch's kernels", file=sys.stderr)
            return 0
        print(f"built {path}")
        if "--sanitize" in argv:  # loading it needs libasan preloaded (make check-native does it)
            return 0
    print(ops.backend_line())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
