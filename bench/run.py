"""``make bench``: every suite in its own process, then one combined table.

Each suite prints its own table and JSON and writes ``bench/results/<suite>.json``; this runner
reads those files back and prints all rows together, with each suite's elapsed time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, Row, cpu_name, table

SUITES = (
    *("train", "eval", "eval_memory", "sample", "speculative"),
    *("beam", "tokenize", "load", "serve", "prefix", "lora", "cpu_decode", "tasks", "fsdp", "structured"),
    *("quant_quality", "quant_kld"),
)
ROOT = Path(__file__).resolve().parents[1]


def load_rows(suite: str) -> list[Row]:
    payload = json.loads((RESULTS / f"{suite}.json").read_text())
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in row.items() if k in fields}) for row in payload["rows"]]


def main() -> int:
    suites = sys.argv[1:] or list(SUITES)
    rows: list[Row] = []
    elapsed: dict[str, float] = {}
    failed = []
    t_all = time.perf_counter()
    for suite in suites:
        print(f"\n=== {suite} ===", flush=True)
        (RESULTS / f"{suite}.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", f"bench.bench_{suite}"], cwd=ROOT)
        elapsed[suite] = time.perf_counter() - t0
        print(f"=== {suite}: {elapsed[suite]:.0f} s ===", flush=True)
        if done.returncode != 0 or not (RESULTS / f"{suite}.json").exists():
            failed.append(suite)
            continue
        rows.extend(load_rows(suite))
    total = time.perf_counter() - t_all
    print(f"\nall suites ({cpu_name()}, {total / 60:.1f} min in all)")
    print(table(rows))
    print("elapsed: " + ", ".join(f"{s} {t:.0f} s" for s, t in elapsed.items()) + f"; total {total:.0f} s")
    missed = [r.name for r in rows if r.meets_goal is False]
    print(f"goals met: {sum(r.meets_goal is True for r in rows)} of {sum(r.goal is not None for r in rows)}")
    if missed:
        print("goals missed: " + "; ".join(missed))
    if failed:
        print(f"suites that failed: {', '.join(failed)}")
    (RESULTS / "all.json").write_text(
        json.dumps(
            {"elapsed_s": elapsed, "total_s": total, "rows": [r.to_dict() for r in rows]},
            indent=2,
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
