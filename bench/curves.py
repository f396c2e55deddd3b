"""Validation loss against wall time for several runs, in one PNG (the README's time-to-quality plot).

    python -m bench.curves RUN_DIR[=LABEL] ... --out docs/shakespeare-time-to-quality.png [--target 1.886]

A run's wall time at a validation is the ``elapsed`` of the training record logged at that step
(the log interval divides the validation interval in the recipes), so time spent validating
counts. Prints each run's final validation loss, its time, and when it first reached ``--target``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lmcli.train.metrics import MetricsLog


def val_curve(run: Path) -> list[tuple[float, float]]:
    """(seconds, validation loss) at every validation of ``run``."""
    records = MetricsLog(run / "metrics.jsonl").read()
    elapsed = {r["step"]: r["elapsed"] for r in records if "elapsed" in r}
    return [(elapsed[r["step"]], r["val_loss"]) for r in records if "val_loss" in r and r["step"] in elapsed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders, each optionally =LABEL")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", type=float, default=None, help="a loss to mark and time")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for spec in args.runs:
        path, _, label = spec.partition("=")
        curve = val_curve(Path(path))
        if not curve:
            raise SystemExit(f"{path}: no validation records with a time")
        ax.plot(*zip(*curve, strict=True), marker="o", markersize=3, label=label or Path(path).name)
        line = f"{label or path}: final {curve[-1][1]:.4f} at {curve[-1][0]:.0f} s"
        if args.target is not None:
            hit = next((t for t, loss in curve if loss <= args.target), None)
            line += f"; <= {args.target} at {hit:.0f} s" if hit is not None else f"; never <= {args.target}"
        print(line)
    if args.target is not None:
        ax.axhline(args.target, color="gray", linestyle="--", linewidth=1, label=f"loss {args.target}")
    ax.set_xlabel("seconds since training started (validation included)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
