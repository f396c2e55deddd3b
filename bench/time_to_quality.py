"""Time to quality, side by side on one machine: nanoGPT's Tiny Shakespeare recipe against
lmcli's modern recipe, and the default ``lmcli train`` with and without the recipe's options.

    python -m bench.time_to_quality [--only shakespeare default] [--threads N]

Parts (``--only``):

- ``shakespeare``: ``configs/shakespeare-char.toml`` (nanoGPT's CPU recipe) then
  ``configs/shakespeare-char-modern.toml``, each a fresh ``lmcli train`` process. Reported: the
  final validation loss, the wall time of training (validation included), and when each first
  reached nanoGPT's 1.886; the goal is 1.886 in at most a third of the baseline's time.
- ``shakespeare-long``: ``configs/shakespeare-char-long.toml`` (the modern recipe with a longer
  context for a longer budget) given the baseline's whole training time as ``--max-time``, over
  which its schedule decays; goal: validation loss <= 1.55. Runs the baseline first.
- ``default``: ``lmcli train`` with no arguments (built-in corpus, 800 steps; Muon and wsd are
  the defaults), beside the defaults before issue 18 (``BEFORE``: AdamW, cosine) and the
  default with the Shakespeare recipe's architecture too (``DEFAULT_RECIPE``: QK-norm, rotary,
  ReLU; not exportable to GPT-2); goal: the default's validation loss <= 1.80 in < 3 minutes.

- ``multi30k``: ``configs/multi30k-en-de.toml`` (27 minutes of training), then ``lmcli average
  --last 4``; of ``best``, ``last`` and that average the one with the highest beam-5 BLEU on val
  is reported on val and test_2016_flickr, beam 1 and 5 (sacreBLEU cased, lowercased, chrF);
  goal: test BLEU >= 33.0 with beam 5. ``--multi30k-run DIR`` evaluates a finished run of the
  recipe instead of training one.

The ``shakespeare`` and ``default`` parts take about 12 minutes on two idle cores, ``multi30k``
about 35. Results go to bench/results/time_to_quality.json (a part not run keeps its last
result there).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LMCLI_DATA", ROOT.parent / "shared" / "data"))
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
RESULTS = ROOT / "bench" / "results" / "time_to_quality.json"
TARGET, LONG_TARGET, DEFAULT_TARGET = 1.886, 1.55, 1.80
BASELINE, MODERN = "configs/shakespeare-char.toml", "configs/shakespeare-char-modern.toml"
LONG = "configs/shakespeare-char-long.toml"
# the default `lmcli train` before issue 18, and with the modern recipe's architecture as well
BEFORE = ["--optimizer", "adamw", "--schedule", "cosine"]
DEFAULT_RECIPE = ["--qk-norm", "--position", "rope", "--mlp", "relu"]
PARTS = ("shakespeare", "shakespeare-long", "default", "multi30k")
MULTI30K, MULTI30K_TARGET = "configs/multi30k-en-de.toml", 33.0
# lmcli beam's length limits for Multi30k (docs/translation.md)
BEAM_ARGS = ["--max-len-a", "1.5", "--max-len-b", "10"]


def lmcli_train(args: list[str], out: Path, threads: int | None) -> dict[str, Any]:
    """One ``lmcli train`` process; its wall time, final validation loss and validation curve."""
    t0 = time.perf_counter()
    lmcli(["train", *args, "--out", str(out), "-q"], threads)
    wall = time.perf_counter() - t0
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


def lmcli(args: list[str], threads: int | None) -> None:
    """One ``lmcli`` command in a fresh process; its failure ends the script."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "lmcli", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def translate(ckpt: Path, split: str, beam: int, threads: int | None) -> dict[str, Any]:
    """``lmcli beam`` over a Multi30k split and sacreBLEU of its output (cased, lowercased, chrF)."""
    from lmcli.eval.bleu import score_translations

    source, reference = (DATA / "multi30k" / f"{split}.{lang}.gz" for lang in ("en", "de"))
    hyp = ckpt.parent / f"{ckpt.name}.{split}.beam{beam}.de"
    t0 = time.perf_counter()
    lmcli(
        [
            "beam",
            str(ckpt),
            "--input",
            str(source),
            "--output",
            str(hyp),
            "--beam-size",
            str(beam),
            *BEAM_ARGS,
        ],
        threads,
    )
    with gzip.open(reference, "rt", encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    scores = score_translations(hyp.read_text(encoding="utf-8").splitlines(), refs)
    return {**scores, "decode_s": time.perf_counter() - t0}


def multi30k(run_dir: Path | None, tmp: Path, threads: int | None) -> dict[str, Any]:
    """The Multi30k recipe: train it (or take a run of it), choose among ``best``, ``last`` and
    the average of the last 4 step checkpoints by beam-5 BLEU on val only, then report val and
    test_2016_flickr with beam 1 and 5."""
    out: dict[str, Any] = {}
    if run_dir is None:
        run_dir = tmp / "multi30k"
        out["train"] = lmcli_train(["--config", MULTI30K], run_dir, threads)
    lmcli(["average", str(run_dir), "--last", "4", "--out", str(run_dir / "average-last-4")], threads)
    candidates = {name: run_dir / name for name in ("best", "last", "average-last-4")}
    out["val_beam5"] = {name: translate(path, "val", 5, threads) for name, path in candidates.items()}
    chosen = max(candidates, key=lambda name: out["val_beam5"][name]["bleu"])
    out["chosen"] = chosen
    out["val_beam1"] = translate(candidates[chosen], "val", 1, threads)
    out["test_beam5"] = translate(candidates[chosen], "test_2016_flickr", 5, threads)
    out["test_beam1"] = translate(candidates[chosen], "test_2016_flickr", 1, threads)
    return out


def multi30k_lines(m30k: dict[str, Any], met: bool) -> list[str]:
    """The Multi30k part's report: training, each candidate on val, the chosen one on test."""
    lines = []
    if "train" in m30k:
        lines.append(f"{MULTI30K}: {m30k['train']['steps']} steps in {m30k['train']['train_s']:.0f} s")
    for name, scores in m30k["val_beam5"].items():
        lines.append(f"  val, beam 5, {name}: {scores['summary']}")
    for key in ("val_beam1", "test_beam5", "test_beam1"):
        split, beam = key.split("_")
        lines.append(f"  {split}, {beam}, {m30k['chosen']} (chosen on val): {m30k[key]['summary']}")
    lines.append(f"  test BLEU with beam 5 (goal >= {MULTI30K_TARGET}): {'met' if met else 'MISSED'}")
    return lines


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
    parser.add_argument(
        "--multi30k-run",
        type=Path,
        default=None,
        help="multi30k: evaluate this finished run of the recipe instead of training one",
    )
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
            # the long recipe given the baseline's whole time, over which its schedule decays
            long_args = [str(SHAKESPEARE), "--config", LONG, "--max-time", f"{base['train_s']:.0f}s"]
            long = lmcli_train(long_args, tmp / "long", args.threads)
            out["parts"]["shakespeare-long"] = long
            best = min(long["val_loss"], long["val_loss_ema"] or long["val_loss"])
            met = best <= LONG_TARGET
            ok &= met
            lines.append(
                f"{LONG} for the baseline's {base['train_s']:.0f} s: val loss {best:.4f} "
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
        if "multi30k" in args.only:
            m30k = multi30k(args.multi30k_run, tmp, args.threads)
            out["parts"]["multi30k"] = m30k
            met = m30k["test_beam5"]["bleu"] >= MULTI30K_TARGET
            ok &= met
            lines += multi30k_lines(m30k, met)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():  # the parts not run this time keep their last results
        out["parts"] = {**json.loads(RESULTS.read_text()).get("parts", {}), **out["parts"]}
    RESULTS.write_text(json.dumps(out, indent=2))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
