"""Shared benchmark plumbing: timing, result rows, the table and the JSON file."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    """One comparison: lmcli's figure, the peer's, their ratio and the goal for that ratio."""

    name: str
    unit: str
    lmcli: float
    peer: float
    peer_name: str
    goal: float | None = None  # the ratio lmcli/peer we aim for (higher is better)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.lmcli / self.peer if self.peer else float("nan")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["meets_goal"] = None if self.goal is None else self.ratio >= self.goal
        return d


def best_time(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> float:
    """Fastest wall time of ``repeats`` calls after ``warmup`` untimed ones (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def report(suite: str, rows: list[Row]) -> Path:
    """Print a table of rows and write them as JSON to bench/results/<suite>.json."""
    print(f"\n{suite}")
    print(f"{'benchmark':<44} {'lmcli':>12} {'peer':>12} {'unit':<10} {'ratio':>7} {'goal':>6}")
    for r in rows:
        goal = f"{r.goal:.2f}" if r.goal is not None else "-"
        print(f"{r.name:<44} {r.lmcli:>12.4g} {r.peer:>12.4g} {r.unit:<10} {r.ratio:>7.2f} {goal:>6}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{suite}.json"
    payload = {"suite": suite, "machine": machine(), "rows": [r.to_dict() for r in rows]}
    out.write_text(json.dumps(payload, indent=2))
    print(json.dumps([r.to_dict() for r in rows]))
    return out
