"""DDP and FSDP through torchrun (2 CPU processes, gloo) against one process with the same global
batch.

Two ranks with batch B read windows ``cursor .. cursor+B-1`` and ``cursor+B .. cursor+2B-1`` of
the global stream, average their gradients and evaluate halves of one validation set; one process
with batch 2B reads the same windows in one batch. With dropout 0 the two runs compute the same
thing in a different float32 summation order, so their metrics and weights must agree to
rounding. A wrong slice (both ranks reading the same windows), gradients not averaged, or a
validation set that depends on the world size, each moves them by orders of magnitude more.

FSDP (``--parallel fsdp``) computes the same steps with each parameter, gradient and optimizer
state split over the ranks; its checkpoints are sharded (DCP) beside whole weights, and resume on
two processes bit-identically or on one to rounding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_TEXT,
    assert_one_line_error,
    make_run,
    read_metrics,
    run_cli,
    saved_step,
    temps,
    weights,
)
from safetensors.torch import load_file

from lmcli.cli.app import main as lmcli_main
from lmcli.safe_io import pid_alive

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


def torchrun(args: list[str], cwd: Path) -> subprocess.Popen:
    """``lmcli ARGS`` on 2 ranks under torchrun (one thread each), started."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.Popen(
        [*launch, "-m", "lmcli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def train_both(
    tmp: Path,
    extra: list[str],
    single: tuple[str, ...] = ("--batch-size", str(2 * B)),
    ranks: tuple[str, ...] = (),
    rank_batch: int = B,
) -> dict:
    """Train with ``FLAGS + extra`` under torchrun (2 ranks, batch ``rank_batch``, and ``ranks``'
    flags) and in this process (by default with batch 2B; ``single``: other flags of the same
    global batch)."""
    corpus = tmp / "corpus.txt"
    corpus.write_text(TINY_TEXT * 2)  # 25 validation windows, of which 16 (2 global batches) are read
    common = [str(corpus), *FLAGS, *extra]
    # no --out: the default checkpoints/run-<time>, whose name rank 0 chooses
    two = ["train", *common, *ranks, "--batch-size", str(rank_batch), "--cache-dir", str(tmp / "c2")]
    with torchrun(two, tmp) as proc:
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
            _, stderr = proc.communicate(timeout=600)
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


def test_distillation_under_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """--task distill: each rank runs the teacher beside its student on its own windows; the
    global batch's loss, gradients and validation (its KL from the teacher too) are one
    process's. (On-policy rows are sampled by each rank with its own seeds: not compared.)"""
    teacher = make_run(tmp_path / "teacher", text=TINY_TEXT * 2, n_layer=2, block_size=32)
    runs = train_both(tmp_path, ["--task", "distill", "--teacher", str(teacher), "--distill-alpha", "0.5"])
    run = ddp_run(runs)
    assert_close_runs(run, runs["single"])
    val = [
        (a["val_kl"], b["val_kl"])
        for a, b in zip(read_metrics(run), read_metrics(runs["single"]), strict=True)
        if "val_kl" in a
    ]
    assert len(val) == 2 and all(a == pytest.approx(b, rel=METRIC_RTOL) for a, b in val)


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


# ----------------------------------------------------------------------------- FSDP


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 2-rank FSDP run with AdamW, 2 micro-batches of B/2 a step and gradients clipped
    (sharded checkpoints at steps 10 and 20 kept), and a 1-process run with the same global
    batch: 2 micro-batches of B (the same validation windows: 2 batches of B)."""
    extra = ["--optimizer", "adamw", "--keep-last", "2", "--grad-accum", "2", "--grad-clip", "0.5"]
    ranks = ("--parallel", "fsdp")
    return train_both(
        tmp_path_factory.mktemp("fsdp"), extra, ("--batch-size", str(B)), ranks, rank_batch=B // 2
    )


def interrupted_at_step_10(run: Path, dest: Path) -> Path:
    """A copy of ``run`` as a crash after step 10's checkpoint leaves it (``last/`` at step 10)."""
    shutil.copytree(run, dest)
    shutil.rmtree(dest / "last")
    shutil.copytree(dest / "step-0000010", dest / "last")
    return dest


def test_fsdp_equals_one_process_and_writes_sharded_checkpoints_with_whole_weights(
    fsdp: dict, capsys
) -> None:
    run = ddp_run(fsdp)
    assert_close_runs(run, fsdp["single"])
    losses = [r["train_loss"] for r in read_metrics(run) if "train_loss" in r]
    assert losses == pytest.approx(
        [r["train_loss"] for r in read_metrics(fsdp["single"]) if "train_loss" in r], abs=1e-5
    )
    assert losses[-1] < losses[0] - 0.3, "the model learns: the weights compared have moved far"
    assert min(r["grad_norm"] for r in read_metrics(run) if "grad_norm" in r) > 0.5, "clipped"
    files = {p.name for p in (run / "last").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "model.safetensors", "meta.json"} <= files
    assert "trainer_state.pt" not in files
    assert fsdp["stderr"].count("done in") == 1, "rank 0 alone reports"
    code, out, _ = run_cli(["sample", str(run / "last"), "--prompt", "the", "--max-new-tokens", "8"], capsys)
    assert code == 0 and out.startswith("the") and len(out.strip()) > 3


def test_a_sharded_checkpoint_resumes_exactly_on_two_processes_and_to_rounding_on_one(
    fsdp: dict, tmp_path: Path
) -> None:
    run = ddp_run(fsdp)
    two, one = interrupted_at_step_10(run, tmp_path / "two"), interrupted_at_step_10(run, tmp_path / "one")
    with torchrun(["train", "--resume", str(two), "--parallel", "fsdp", "-q"], tmp_path) as proc:
        cli("train", "--resume", str(one), "--batch-size", str(B), "-q")  # meanwhile, alone
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    measured = ("train_loss", "grad_norm", "val_loss")
    full, again, alone = ([{k: r.get(k) for k in measured} for r in read_metrics(x)] for x in (run, two, one))
    assert again == full, "the 2-process continuation logs the same values"
    resumed = weights(two)
    for key, value in weights(run).items():
        assert torch.equal(resumed[key], value), f"{key}: the 2-process resume is bit-identical"
    assert len(alone) == len(full)
    for a, b in zip(alone, full, strict=True):
        assert a == pytest.approx(b, abs=1e-6), "the 1-process continuation, to rounding"


def test_a_bad_sharded_checkpoint_is_refused_in_one_line(fsdp: dict, tmp_path: Path, capsys) -> None:
    run = ddp_run(fsdp)
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "last" / "__1_0.distcp").unlink()
    code, _, err = run_cli(["train", "--resume", str(partial), "-q"], capsys)
    assert_one_line_error(code, err, "is missing __1_0.distcp")
    meta = json.loads((partial / "last" / "meta.json").read_text())
    del meta["sha256"]["__1_0.distcp"]  # a checksum list that does not name it either
    (partial / "last" / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["train", "--resume", str(partial), "-q"], capsys)
    assert_one_line_error(code, err, "is missing its shard __1_0.distcp")
    code, _, err = run_cli(["train", "--resume", str(run), "--n-layer", "3", "-q"], capsys)
    assert_one_line_error(code, err, "cannot resume with a different model shape")


class Planted:
    """A pickle that runs a command when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_shard_index_runs_no_code(fsdp: dict, tmp_path: Path, capsys) -> None:
    """DCP reads its index with pickle.load: a run folder is untrusted, so lmcli reads it with
    an unpickler that builds DCP's record types alone (even under a matching checksum)."""
    planted = tmp_path / "planted"
    shutil.copytree(ddp_run(fsdp), planted)
    index = planted / "last" / ".metadata"
    index.write_bytes(pickle.dumps(Planted(tmp_path / "ran")))
    meta = json.loads((planted / "last" / "meta.json").read_text())
    meta["sha256"][".metadata"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (planted / "last" / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["train", "--resume", str(planted), "-q"], capsys)
    assert_one_line_error(code, err, "posix.system is not part of a checkpoint index")
    assert not (tmp_path / "ran").exists()


def test_fsdp_with_muon_and_ema_equals_one_process(tmp_path: Path) -> None:
    """Muon orthogonalizes each sharded matrix whole (gathered on one rank, its rows sent back):
    the step of one process reading the same two micro-batches (see the DDP test above)."""
    muon = ["--optimizer", "muon", "--muon-lr", "0.02", "--ema", "0.9"]
    single = ("--batch-size", str(B), "--grad-accum", "2")
    runs = train_both(tmp_path, muon, single=single, ranks=("--parallel", "fsdp"))
    run, one = ddp_run(runs), runs["single"]
    losses = [[r["train_loss"] for r in read_metrics(x) if "train_loss" in r] for x in (run, one)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    for which in ("last", "ema"):
        wa, wb = weights(run, which), weights(one, which)
        for key in wa:
            diff = (wa[key] - wb[key]).abs().max().item()
            assert diff <= WEIGHT_ATOL, f"{which}: {key} differs by {diff:.2e}"

    # the one process's whole checkpoint (trainer_state.pt) resumes sharded: each rank takes
    # its rows of the Muon and AdamW state and of the average
    shutil.copytree(one, tmp_path / "again")
    longer = ["--max-steps", str(STEPS + MORE), "-q"]
    same_batch = ["--grad-accum", "1"]  # 2 ranks x B = the one process's B x 2 micro-batches
    with torchrun(
        ["train", "--resume", str(one), "--parallel", "fsdp", *same_batch, *longer], tmp_path
    ) as proc:
        cli("train", "--resume", str(tmp_path / "again"), *longer)
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    sharded, alone = (
        [r["train_loss"] for r in read_metrics(x) if "train_loss" in r] for x in (one, tmp_path / "again")
    )
    assert len(sharded) == STEPS + MORE and sharded == pytest.approx(alone, abs=1e-5)
    assert (one / "last" / "__1_0.distcp").is_file()


def test_fsdp_lora_from_a_hugging_face_folder_equals_one_process(tmp_path: Path, capsys) -> None:
    """Each rank builds the base on the meta device and reads only its rows of the HF weights."""
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
    shape["position"] = "rope"  # a Llama: export writes one
    base = make_run(tmp_path / "base", seed=4, **shape)
    assert run_cli(["export", str(base), str(tmp_path / "hf"), "--format", "hf"], capsys)[0] == 0
    lora = ["--init-from", str(tmp_path / "hf"), "--lora-rank", "4", "--lr", "1e-2"]
    runs = train_both(tmp_path, lora, ranks=("--parallel", "fsdp"))
    run, one = ddp_run(runs), runs["single"]
    losses = [[r["train_loss"] for r in read_metrics(x) if "train_loss" in r] for x in (run, one)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and losses[0][-1] < losses[0][0] - 0.1
    wa, wb = (load_file(x / "last" / "adapters.safetensors") for x in (run, one))
    assert wa.keys() == wb.keys() and any("lora_a" in k for k in wa)
    for key in wa:
        assert (wa[key] - wb[key]).abs().max().item() <= WEIGHT_ATOL, key


def test_sigkill_of_a_sharded_run_then_resume_in_one_process(tmp_path: Path) -> None:
    """Killed while it trains and writes a sharded checkpoint at every step (in the background):
    the last checkpoint in place is whole and resumes in one process, which then takes the
    steps of an uninterrupted one-process run."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT * 2)
    steps = 40
    # one block: after a validation (a forward alone) every parameter is still gathered
    one_block = [
        ("1" if before == "--n-layer" else flag)
        for before, flag in zip(["", *FLAGS[:-1]], FLAGS, strict=True)
    ]
    common = [str(corpus), *one_block, "--optimizer", "adamw", "--max-steps", str(steps)]
    killed = tmp_path / "killed"
    argv = ["train", *common, "--batch-size", str(B), "--parallel", "fsdp", "--save-interval", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with subprocess.Popen(
        [*launch, "-m", "lmcli", *argv, "--out", str(killed)],
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        deadline = time.time() + 600  # generous: a loaded machine may pause processes
        while saved_step(killed) < 12 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # torchrun first: it starts nothing more
        proc.wait(30)
        kill_all_naming(killed, deadline)
    step = saved_step(killed)
    assert 12 <= step < steps, "killed mid-run, after a validation and a few checkpoints"
    cli("train", "--resume", str(killed), "--batch-size", str(2 * B))
    cli("train", *common, "--batch-size", str(2 * B), "--out", str(tmp_path / "whole"))
    assert not temps(killed), "temporaries removed"
    losses = [
        {r["step"]: r["train_loss"] for r in read_metrics(x) if "train_loss" in r}
        for x in (killed, tmp_path / "whole")
    ]
    assert sorted(losses[0]) == list(range(1, steps + 1))
    assert [losses[0][s] for s in range(1, steps + 1)] == pytest.approx(
        [losses[1][s] for s in range(1, steps + 1)], abs=1e-5
    )


def naming(text: str) -> list[int]:
    """The live processes whose command line holds ``text`` (Linux's /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # one that ended meanwhile, or another user's
            command = (entry / "cmdline").read_bytes().decode(errors="replace")
            if text in command and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def kill_all_naming(run: Path, deadline: float) -> None:
    """SIGKILL every process training into ``run`` (torchrun's workers, in their own sessions, and
    anything they forked) until none runs and the folder's lock is free. A scan of the command
    lines, not of /proc's ``children`` lists: those can miss a child of a running process."""
    import fcntl

    while time.time() < deadline:
        alive = naming(str(run))
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not alive:
            try:
                fd = os.open(run / ".lock", os.O_RDONLY)
            except FileNotFoundError:  # released on the way out
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the dead released it
                return
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.02)
    raise AssertionError(f"processes training into {run} outlived SIGKILL: {naming(str(run))}")
