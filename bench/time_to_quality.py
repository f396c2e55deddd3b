"""Time to quality, side by side on one machine: nanoGPT's Tiny Shakespeare recipe against
lmcli's modern recipe, and the default ``lmcli train`` with and without the recipe's options.

    python -m bench.time_to_quality [--only shakespeare default] [--threads N]

Parts (``--only``):

- ``shakespeare``: ``configs/shakespeare-char.toml`` (nanoGPT's CPU recipe) then
  ``configs/shakespeare-char-modern.toml``, each a fresh ``lmcli train`` process. Reported: the
  final validation loss, the wall time of training (validation included), and when each first
  reached nanoGPT's 1.886; the goal is 1.886 in at most a third of the baseline's time.
- ``shakespeare-long``: the modern recipe given the baseline's whole training time: its steps
  scaled by the two runs' times (the schedule decays over them), the baseline's time also a hard
  limit (``--max-time``); goal: validation loss <= 1.55. Runs the baseline and the recipe first.
- ``default``: ``lmcli train`` with no arguments (built-in corpus, 800 steps; Muon and wsd are
  the defaults), beside the defaults before issue 18 (``BEFORE``: AdamW, cosine) and the
  default with the Shakespeare recipe's architecture too (``DEFAULT_RECIPE``: QK-norm, rotary,
  ReLU; not exportable to GPT-2); goal: the default's validation loss <= 1.80 in < 3 minutes.

The ``shakespeare`` and ``default`` parts take about 12 minutes on two idle cores. Results go to
bench/results/time_to_quality.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LMCLI_DATA", "/work/shared/data"))
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
RESULTS = ROOT / "bench" / "results" / "time_to_quality.json"
TARGET, LONG_TARGET, DEFAULT_TARGET = 1.886, 1.55, 1.80
BASELINE, MODERN = "configs/shakespeare-char.toml", "configs/shakespeare-char-modern.toml"
# the default `lmcli train` before issue 18, and with the modern recipe's architecture as well
BEFORE = ["--optimizer", "adamw", "--schedule", "cosine"]
DEFAULT_RECIPE = ["--qk-norm", "--position", "rope", "--mlp", "relu"]
PARTS = ("shakespeare", "shakespeare-long", "default")


def lmcli_train(args: list[str], out: Path, threads: int | None) -> dict[str, Any]:
    """One ``lmcli train`` process; its wall time, final validation loss and validation curve."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "lmcli", "train", *args, "--out", str(out), "-q"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed"] for r in records if "elapsed" in r}
    curve = [
        (elapsed.get(r["step"]), r["val_loss"], r.get("val_loss_ema")) for r in records if "val_loss" in r
    ]
    return {
        "command": "lmcli train " + " ".join(args),
        "wall_s": wall,
        "train_s": max(elapsed.values()),
        "steps": max(elapsed),
        "val_loss": curve[-1][1],
        "val_loss_ema": curve[-1][2],
        "curve": curve,
    }


def first_at(run: dict[str, Any], target: float) -> float | None:
    """Seconds of training (validation included) at the first validation at or below ``target``."""
    for t, loss, ema in run["curve"]:
        if t is not None and min(loss, ema if ema is not None else loss) <= target:
            return t
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=PARTS, default=["shakespeare", "default"])
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run")
    args = parser.parse_args()
    out: dict[str, Any] = {"threads": args.threads, "parts": {}}
    lines: list[str] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if "shakespeare" in args.only or "shakespeare-long" in args.only:
            base = lmcli_train([str(SHAKESPEARE), "--config", BASELINE], tmp / "baseline", args.threads)
            out["parts"]["shakespeare-baseline"] = base
            lines.append(f"{BASELINE}: val loss {base['val_loss']:.4f} after {base['train_s']:.0f} s")
        if "shakespeare" in args.only:
            modern = lmcli_train([str(SHAKESPEARE), "--config", MODERN], tmp / "modern", args.threads)
            out["parts"]["shakespeare-modern"] = modern
            hit = first_at(modern, TARGET)
            budget = base["train_s"] / 3
            met = hit is not None and hit <= budget
            ok &= met
            lines.append(
                f"{MODERN}: val loss {modern['val_loss']:.4f} after {modern['train_s']:.0f} s; "
                f"<= {TARGET} at "
                + (f"{hit:.0f} s" if hit is not None else "never")
                + f" (goal: <= {budget:.0f} s, a third of the baseline's): {'met' if met else 'MISSED'}"
            )
        if "shakespeare-long" in args.only:
            if "shakespeare-modern" not in out["parts"]:
                modern = lmcli_train([str(SHAKESPEARE), "--config", MODERN], tmp / "modern", args.threads)
                out["parts"]["shakespeare-modern"] = modern
            # the recipe's steps scaled to the baseline's time (its schedule decays over steps),
            # the baseline's time also a hard limit
            steps = round(modern["steps"] * base["train_s"] / modern["train_s"])
            long_args = [str(SHAKESPEARE), "--config", MODERN, "--max-steps", str(steps)]
            long_args += ["--max-time", f"{base['train_s']:.0f}s"]
            long = lmcli_train([*long_args, "--eval-interval", "500"], tmp / "long", args.threads)
            out["parts"]["shakespeare-long"] = long
            best = min(long["val_loss"], long["val_loss_ema"] or long["val_loss"])
            met = best <= LONG_TARGET
            ok &= met
            lines.append(
                f"modern recipe for the baseline's {base['train_s']:.0f} s: val loss {best:.4f} "
                f"(goal <= {LONG_TARGET}): {'met' if met else 'MISSED'}"
            )
        if "default" in args.only:
            for name, extra in (("default", []), ("before", BEFORE), ("default-recipe", DEFAULT_RECIPE)):
                run = lmcli_train(extra, tmp / name, args.threads)
                out["parts"][name] = run
                met = run["val_loss"] <= DEFAULT_TARGET and run["train_s"] < 180
                if name == "default":
                    ok &= met
                lines.append(
                    f"{run['command']}: val loss {run['val_loss']:.4f} after {run['train_s']:.0f} s "
                    f"(goal <= {DEFAULT_TARGET} in < 180 s): {'met' if met else 'missed'}"
                )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
