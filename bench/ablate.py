"""Issue 18's ablations on Tiny Shakespeare (char): each technique on and off at equal steps,
and each technique's per-step time cost in one interleaved micro-benchmark.

    python -m bench.ablate runs [--steps 300] [--seeds 1337 1338] [--only NAME ...]
    python -m bench.ablate timing [--rounds 4]

``runs`` trains every variant of ``VARIANTS`` (the fast recipe's model and data, one thread)
for the same number of steps and prints the final validation loss over the whole validation
split (and the EMA's); ``timing`` times training steps of each variant against the base in
alternation (A, B, A, B, ...) so that a loaded machine slows both alike. Results are appended
to bench/results/ablate.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmcli.config.files import load_config_file
from lmcli.train import Reporter, train
from lmcli.train.run_folder import resolve_configs

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LMCLI_DATA", ROOT.parent / "shared" / "data"))  # ../shared beside the project
CORPUS = DATA / "tinyshakespeare" / "input.txt"
RESULTS = ROOT / "bench" / "results" / "ablate.jsonl"

BASE = "configs/shakespeare-char-fast.toml"
# the recipe under test: every technique on (over the base recipe's model and data)
FULL: dict[str, Any] = {
    "optimizer": "muon",
    "schedule": "wsd",
    "qk_norm": True,
    "mlp": "relu2",
    "zero_init": True,
    "logit_softcap": 15.0,
    "ema": 0.98,
}
# each variant: options over the base recipe; "no-X": the full recipe without technique X
OFF = {
    "muon": {"optimizer": "adamw"},
    "wsd": {"schedule": "cosine"},
    "qk-norm": {"qk_norm": False},
    "relu2": {"mlp": "relu"},
    "zero-init": {"zero_init": False},
    "softcap": {"logit_softcap": 0.0},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "full": FULL,
    "full-muon.04": {**FULL, "muon_lr": 0.04},
    **{f"no-{k}": {**FULL, **v} for k, v in OFF.items()},
    # for the timing micro-benchmark: one technique alone over the base
    **{f"only-{k}": {k2: FULL[k2] for k2 in FULL if OFF[k].keys() >= {k2}} for k in OFF},
    "only-ema": {"ema": 0.98},
    # what the ablations kept (configs/shakespeare-char-modern.toml): Muon, wsd, QK-norm
    "recipe": {"optimizer": "muon", "schedule": "wsd", "qk_norm": True},
}


def options(name: str, steps: int, seed: int, extra: dict[str, Any]) -> dict[str, Any]:
    opts = load_config_file(ROOT / BASE)
    opts.update(
        corpus=(str(CORPUS),),
        max_steps=steps,
        eval_interval=steps,
        log_interval=steps,
        seed=seed,
        warmup_steps=min(opts.get("warmup_steps", 50), steps // 6),
    )
    opts.update(VARIANTS.get(name, {}))
    opts.update(extra)
    return opts


def run_variant(name: str, steps: int, seed: int, extra: dict[str, Any], tmp: Path) -> dict[str, Any]:
    opts = options(name, steps, seed, extra)
    model_cfg, train_cfg = resolve_configs({}, {**opts, "out": str(tmp / f"{name}-{seed}-{time.time_ns()}")})
    t0, c0 = time.perf_counter(), time.process_time()
    result = train(model_cfg, train_cfg, reporter=Reporter(info=lambda m: None), progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "val_loss" in r][-1]
    return {
        "variant": name,
        "extra": extra,
        "steps": steps,
        "seed": seed,
        "val_loss": last["val_loss"],
        "val_loss_ema": last.get("val_loss_ema"),
        "wall_s": wall,
        "cpu_s": cpu,  # one thread: the run's own compute, less sensitive to the others' load
        "load": os.getloadavg()[0],
    }


def step_seconds(name: str, extra: dict[str, Any], steps: int, tmp: Path) -> float:
    """Seconds per training step of a variant (a short run, validation excluded)."""
    opts = options(name, steps, 1337, extra)
    opts.update(eval_interval=10**6, eval_batches=1)
    model_cfg, train_cfg = resolve_configs({}, {**opts, "out": str(tmp / f"t-{name}-{time.time_ns()}")})
    result = train(model_cfg, train_cfg, reporter=Reporter(info=lambda m: None), progress=False)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "elapsed" in r][-1]["elapsed"] / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["runs", "timing"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337])
    parser.add_argument("--only", nargs="+", default=list(VARIANTS))
    parser.add_argument("--set", nargs="*", default=[], help="extra options as key=json")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.mode == "runs":
            for seed in args.seeds:
                for name in args.only:
                    row = run_variant(name, args.steps, seed, extra, tmp)
                    print(json.dumps(row), flush=True)
                    with RESULTS.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            return
        times: dict[str, list[float]] = {name: [] for name in args.only}
        for _ in range(args.rounds):  # base, variant, base, variant ...: the load hits both alike
            for name in args.only:
                times[name].append(step_seconds(name, extra, args.steps, tmp))
        base = statistics.median(times["base"]) if "base" in times else None
        for name, ts in times.items():
            row = {"timing": name, "extra": extra, "step_s": statistics.median(ts), "all": ts}
            if base:
                row["vs_base"] = row["step_s"] / base
            print(json.dumps(row), flush=True)
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
