"""Fixtures of the server tests: a tiny run served on 127.0.0.1 in a background thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_run

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from lmcli.config.commands import ServeConfig  # noqa: E402
from lmcli.formats.checkpoint import Checkpoint  # noqa: E402
from lmcli.formats.sources import load_model  # noqa: E402
from lmcli.serve.server import running  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def served_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with a random 2-layer char model of context 64."""
    return make_run(tmp_path_factory.mktemp("serve") / "run", block_size=CONTEXT)


@pytest.fixture(scope="module")
def checkpoint(served_run: Path) -> Checkpoint:
    return load_model(served_run)


@pytest.fixture(scope="module")
def server(checkpoint: Checkpoint) -> Iterator[str]:
    """The base URL of the run served on a free loopback port (stopped after the module)."""
    with running(checkpoint, ServeConfig(port=0, max_batch=8, max_queue=8, grace=2)) as (url, _):
        yield url
