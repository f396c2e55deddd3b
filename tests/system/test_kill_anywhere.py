"""Fault injection: SIGKILL at 20 random moments of training and saving never loses a run folder.

Each writer is a forked copy of a process that has already imported lmcli and torch (the
``forkserver`` start method with a preload), so 20 starts cost seconds, not 20 interpreter starts;
each runs ``lmcli train`` exactly as the command line does (``lmcli.cli.app.main``).
"""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
import time
from pathlib import Path

import pytest
from helpers import TINY_TEXT, saved_step, temps

from lmcli.cli.app import main
from lmcli.formats.sources import load_checkpoint

KILLS = 20
# what a training run imports, loaded once in the server the writers are forked from
PRELOAD = [
    *("lmcli.cli.app", "lmcli.train.loop", "lmcli.train.display"),
    *("torch._dynamo", "matplotlib.pyplot", "pydantic"),
]
ARGS = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4"),
    *("--eval-interval", "3", "--eval-batches", "1", "--warmup-steps", "1", "--log-interval", "1"),
    *("--save-interval", "1", "--keep-last", "2", "-q"),
]


@pytest.mark.slow
def test_sigkills_at_random_moments_never_lose_the_run(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TINY_TEXT)
    run = tmp_path / "run"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    rng = random.Random(20)
    argv = ["train", str(corpus), "--out", str(run), *ARGS, "--max-steps", "100000"]
    steps = []
    for kill in range(KILLS):
        proc = ctx.Process(target=main, args=(argv,))
        proc.start()
        start = max(saved_step(run), 0)
        deadline = time.time() + 30
        while saved_step(run) <= start:  # past its start (and its cleanup): now training and saving
            assert proc.is_alive(), f"writer {kill} ended early with exit code {proc.exitcode}"
            assert time.time() < deadline, f"writer {kill} made no progress"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        proc.kill()
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        last = run / "last" if (run / "last").exists() else run / "last.old"  # killed between renames
        steps.append(load_checkpoint(last, with_state=True).meta["step"])  # verifies every checksum
        load_checkpoint(run)  # what eval, sample and export open
        # only the writer just killed may have left temporary files: each start removed the others'
        assert all(f".{proc.pid}." in name for name in temps(run)), (proc.pid, temps(run))
        argv = ["train", "--resume", str(run), "-q"]
    assert steps == sorted(steps), "a checkpoint never goes back"
    argv = ["train", "--resume", str(run), "--max-steps", str(steps[-1] + 2), "-q"]
    final = ctx.Process(target=main, args=(argv,))
    final.start()
    final.join(60)
    assert final.exitcode == 0
    assert temps(run) == [] and not list(run.glob("*.old")), sorted(p.name for p in run.iterdir())
    assert load_checkpoint(run / "last").meta["step"] == steps[-1] + 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records if "train_loss" in r]
    assert logged == sorted(set(logged)), "no step logged twice after the resumes"
