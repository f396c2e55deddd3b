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
    """One comparison: lmcli's figure, the peer's, their ratio and the goal for that ratio.

    The ratio is always "how many times better lmcli is": lmcli/peer, or peer/lmcli for a
    figure where lower is better (memory), so a higher ratio is better on every row.
    """

    name: str
    unit: str
    lmcli: float
    peer: float
    peer_name: str
    goal: float | None = None  # the ratio we aim for (higher is better)
    lower_is_better: bool = False
    valid: bool = True  # False when a correctness check of the row failed (then the goal is missed)
    note: str = ""  # printed under the table: what was checked, and how it came out
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        num, den = (self.peer, self.lmcli) if self.lower_is_better else (self.lmcli, self.peer)
        return num / den if den else float("nan")

    @property
    def meets_goal(self) -> bool | None:
        if self.goal is None:
            return None if self.valid else False
        return self.valid and self.ratio >= self.goal

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["meets_goal"] = self.meets_goal
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


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int = 3, warmup: int = 1) -> dict[str, float]:
    """Fastest wall time of each function, calling them in turn (A, B, A, B, ...).

    On a shared, noisy machine, interleaving exposes both sides to the same load.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
    }


# the instruction sets that decide the CPU rows (the products' kernels, torch's GEMMs), as
# /proc/cpuinfo names them: a table is named by its CPU and these
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


def cpu_name() -> str:
    """The CPU's model name and which of ``ISA_FLAGS`` it advertises ("AMD EPYC (avx2, ...)")."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    has = [f for f in ISA_FLAGS if f in flags]
    return f"{name} ({', '.join(has)})" if has else name


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'benchmark':<46} {'lmcli':>11} {'peer':>11} {'unit':<12} {'ratio':>6} {'goal':>6}  met  peer"]
    for r in rows:
        goal = f"{r.goal:.2f}" if r.goal is not None else "-"
        met = {True: "yes", False: "NO", None: "-"}[r.meets_goal]
        lines.append(
            f"{r.name:<46} {r.lmcli:>11.4g} {r.peer:>11.4g} {r.unit:<12} {r.ratio:>6.2f} {goal:>6}  "
            f"{met:<4} {r.peer_name}"
        )
    lines += [f"  {r.name}: {r.note}" for r in rows if r.note]
    return "\n".join(lines)


def report(suite: str, rows: list[Row], elapsed: float | None = None) -> Path:
    """Print a table of rows and write them as JSON to bench/results/<suite>.json."""
    print(f"\n{suite}" + (f" ({elapsed:.0f} s)" if elapsed is not None else ""))
    print(table(rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{suite}.json"
    payload = {
        "suite": suite,
        "machine": machine(),
        "elapsed_s": elapsed,
        "rows": [r.to_dict() for r in rows],
    }
    out.write_text(json.dumps(payload, indent=2))
    print(json.dumps([r.to_dict() for r in rows]))
    return out


def run_suite(suite: str, run: Callable[[], list[Row]]) -> tuple[list[Row], float]:
    """Run one suite, report its rows with its elapsed time, return both."""
    t0 = time.perf_counter()
    rows = run()
    elapsed = time.perf_counter() - t0
    report(suite, rows, elapsed)
    return rows, elapsed


def log(msg: str) -> None:
    """Progress notes while a suite runs (stdout, flushed)."""
    print(f"  {msg}", flush=True)
