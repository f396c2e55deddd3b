"""The one exception type users see: printed as a single line, exit code 2."""


class LmcliError(Exception):
    """A user-facing error: bad input, bad option values, unreadable files.

    The CLI prints ``error: <message>`` to stderr and exits with code 2, never a traceback.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a command stops as on Ctrl-C (the CLI exits with code 143)."""
