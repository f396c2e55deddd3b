"""DDP through torchrun (2 CPU processes, gloo) against one process with the same global batch.

Two ranks with batch B read windows ``cursor .. cursor+B-1`` and ``cursor+B .. cursor+2B-1`` of
the global stream, average their gradients and evaluate halves of one validation set; one process
with batch 2B reads the same windows in one batch. With dropout 0 the two runs compute the same
thing in a different float32 summation order, so their metrics and weights must agree to
rounding. A wrong slice (both ranks reading the same windows), gradients not averaged, or a
validation set that depends on the world size, each moves them by orders of magnitude more.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TINY_TEXT, read_metrics, weights

from lmcli.cli import main as lmcli_main

pytestmark = pytest.mark.slow  # torchrun starts two interpreters per run

if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

STEPS, MORE, B = 20, 6, 4  # B windows per rank; one process takes 2B
FLAGS = [
    *("--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--dropout", "0"),
    *("--max-steps", str(STEPS), "--lr", "3e-3", "--warmup-steps", "2", "--seed", "5"),
    *("--log-interval", "1", "--eval-interval", "10", "--eval-batches", "2", "--val-fraction", "0.2"),
    "-q",
]
# Metrics are sums of float32 terms in another order: they agree to ~3e-7 relative (measured).
METRIC_RTOL = 1e-5
# Weights go through 20 Adam steps; Adam divides by sqrt(v), which magnifies rounding for weights
# whose gradients are near zero: measured up to ~7e-6. A real difference in data or gradients
# moves weights by about the learning rate (3e-3) per step, so 1e-4 separates the two cleanly.
WEIGHT_ATOL = 1e-4


def assert_close_runs(a: Path, b: Path) -> None:
    """Same steps logged; train loss, gradient norm, validation loss and weights within tolerance."""
    ma, mb = read_metrics(a), read_metrics(b)
    assert [(r["step"], sorted(r)) for r in ma] == [(r["step"], sorted(r)) for r in mb]
    for ra, rb in zip(ma, mb, strict=True):
        for key in ("train_loss", "grad_norm", "val_loss"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=METRIC_RTOL), f"{key} at step {ra['step']}"
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        diff = (wa[key] - wb[key]).abs().max().item()
        assert diff <= WEIGHT_ATOL, f"{key} differs by {diff:.2e}"


def cli(*args: str) -> None:
    """``lmcli ARGS`` in this process (a single-process run, without the start-up cost)."""
    lmcli_main(list(args))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """In-process runs on one thread, like each worker: a tiny model only loses to thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 2-rank torchrun run (default run folder) and a 1-process run with the same global batch."""
    return train_both(tmp_path_factory.mktemp("ddp"), [])


def train_both(tmp: Path, extra: list[str], single: tuple[str, ...] = ("--batch-size", str(2 * B))) -> dict:
    """Train with ``FLAGS + extra`` under torchrun (2 ranks, batch B) and in this process (by
    default with batch 2B; ``single``: other flags of the same global batch)."""
    corpus = tmp / "corpus.txt"
    corpus.write_text(TINY_TEXT * 2)  # 25 validation windows, of which 16 (2 global batches) are read
    common = [str(corpus), *FLAGS, *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with subprocess.Popen(
        [*launch, "-m", "lmcli", "train", *common, "--batch-size", str(B), "--cache-dir", str(tmp / "c2")],
        cwd=tmp,  # no --out: the default checkpoints/run-<time>, whose name rank 0 chooses
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        # meanwhile, one process with the same global batch (its own token cache: no shared files)
        cli(
            "train",
            *common,
            *single,
            "--out",
            str(tmp / "single"),
            "--cache-dir",
            str(tmp / "c1"),
        )
        try:
            _, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, stderr[-4000:]
    return {"tmp": tmp, "stderr": stderr, "single": tmp / "single"}


def ddp_run(runs: dict) -> Path:
    folders = list((runs["tmp"] / "checkpoints").iterdir())
    assert len(folders) == 1, f"expected one run folder, found {[f.name for f in folders]}"
    return folders[0]


def test_two_ranks_equal_one_process_with_the_same_global_batch(runs: dict) -> None:
    run = ddp_run(runs)
    assert json.loads((run / "config.json").read_text())["train"]["batch_size"] == B
    assert_close_runs(run, runs["single"])
    losses = [r["train_loss"] for r in read_metrics(run) if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.3, "the model learns: the weights compared have moved far"


def test_only_rank_0_writes_and_prints(runs: dict) -> None:
    run = ddp_run(runs)
    steps = [r["step"] for r in read_metrics(run) if "train_loss" in r]
    assert steps == list(range(1, STEPS + 1)), "one metrics line per step, not one per rank"
    assert [r["step"] for r in read_metrics(run) if "val_loss" in r] == [10, 20]
    names = {p.name for p in run.iterdir()} - {"loss.png"}  # loss.png only with matplotlib
    assert names == {"best", "config.json", "last", "metrics.jsonl"}, "no temporary or stray files"
    assert json.loads((run / "last" / "meta.json").read_text())["step"] == STEPS
    assert runs["stderr"].count("done in") == 1, runs["stderr"][-2000:]


def test_a_two_rank_checkpoint_resumes_in_one_process(runs: dict) -> None:
    """Resume at world size 1 (batch 2B): the same data position, optimizer and schedule."""
    run = ddp_run(runs)
    rngs = torch.load(run / "last" / "trainer_state.pt", weights_only=True)["rng"]
    assert len(rngs) == 2, "rank 0 saved every rank's RNG state"
    longer = ["--max-steps", str(STEPS + MORE), "--batch-size", str(2 * B), "-q"]
    cli("train", "--resume", str(run), *longer)
    cli("train", "--resume", str(runs["single"]), *longer)
    records = read_metrics(run)
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, STEPS + MORE + 1))
    assert all(math.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
    assert json.loads((run / "last" / "meta.json").read_text())["step"] == STEPS + MORE
    # continuing from the 2-rank checkpoint equals continuing the 1-process run
    assert_close_runs(run, runs["single"])


def test_muon_with_ema_under_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """--optimizer muon: DDP averages the gradients before Muon orthogonalizes its momentum, so
    both ranks take the one process's step (and keep the same moving average).

    The one process reads the same two micro-batches of B with --grad-accum 2, so its gradient
    is the same sum as DDP's. (Against one batch of 2B, whose gradient is summed in another
    order, the weights differ by up to 1.6% after 20 steps: Newton-Schulz magnifies rounding in
    the directions of tiny singular values; measured the same between batch 2B and grad-accum 2
    in one process, so it is Muon's, not DDP's.)"""
    muon = ["--optimizer", "muon", "--muon-lr", "0.02", "--ema", "0.9"]
    runs = train_both(tmp_path, muon, single=("--batch-size", str(B), "--grad-accum", "2"))
    run, one = ddp_run(runs), runs["single"]
    train_ddp, train_one = (
        [r["train_loss"] for r in read_metrics(x) if "train_loss" in r] for x in (run, one)
    )
    assert train_ddp == pytest.approx(train_one, rel=METRIC_RTOL)
    for which in ("last", "ema"):
        wa, wb = weights(run, which), weights(one, which)
        for key in wa:
            diff = (wa[key] - wb[key]).abs().max().item()
            assert diff <= WEIGHT_ATOL, f"{which}: {key} differs by {diff:.2e}"
    losses = train_ddp
    losses = [r["train_loss"] for r in read_metrics(run) if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.3
