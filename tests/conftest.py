"""Fixtures only; what tests share otherwise is in helpers.py.

Loading this file puts tests/ on sys.path (pytest's default import mode, no __init__.py files), so
a test in any folder under tests/ can ``from helpers import ...``.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_run

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every test's token cache out of ~/.cache."""
    monkeypatch.setenv("LMCLI_CACHE", str(tmp_path_factory.getbasetemp() / "lmcli-cache"))


@pytest.fixture(autouse=True)
def _signals_kept() -> Iterator[None]:
    """A test leaves SIGINT and SIGTERM as it found them: a handler left behind (or SIGINT left
    ignored) is inherited by every later test's subprocesses and changes what Ctrl-C does there."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = [sig.name for sig, handler in before.items() if signal.getsignal(sig) != handler]
    for sig, handler in before.items():
        signal.signal(sig, handler)
    assert not changed, f"the test left the handler of {', '.join(changed)} changed"


@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    """A run folder holding a random 2-layer char model (``make_run(tmp_path / "run")``)."""
    return make_run(tmp_path / "run")


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip when it is absent."""
    if not SHARED.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED
