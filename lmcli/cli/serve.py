"""``lmcli serve``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer

from lmcli.cli.common import RUN_DIR_HELP, build, loaded_source
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    DeviceConfig,
    ServeConfig,
)
from lmcli.errors import LmcliError


@config_options(ServeConfig, DeviceConfig)
def serve(
    run_dir: Path | None = typer.Argument(None, help=RUN_DIR_HELP),
    *,
    options: dict[str, Any],
) -> None:
    """Serve a model over HTTP: OpenAI-compatible completions and chat, and a chat page at /.

    Stops on SIGTERM or Ctrl-C: no new connections, in-flight requests get --grace seconds.
    """
    try:
        from lmcli.serve.server import serve as run_server
    except ImportError as exc:
        raise LmcliError(f"lmcli serve needs the serve extra (pip install 'lmcli[serve]'): {exc}") from None

    cfg = build(ServeConfig, options)
    if cfg.api_key is None and os.environ.get("LMCLI_API_KEY"):
        cfg = build(ServeConfig, {**options, "api_key": os.environ["LMCLI_API_KEY"]})
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        print(
            f"warning: listening on {cfg.host} without --api-key: anyone who reaches it can use it",
            file=sys.stderr,
        )
    with loaded_source(run_dir, options) as ckpt:
        threads = build(DeviceConfig, options).threads
        run_server(ckpt, cfg, threads=threads, announce=lambda line: print(line, file=sys.stderr, flush=True))
