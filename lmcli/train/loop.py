"""The training loop, top to bottom: open the run, then step, log, validate and save until done.

``train(model_config, train_config)`` is what ``lmcli train`` calls; tests call it too.
``open_run`` builds everything a run holds (folder, data, model, optimizer, ``TrainState``) into
a ``Run``; ``fit`` is the loop; each thing the loop does is one function of the ``Run``. Under
``torchrun`` each rank reads its own slice of every global batch and the model is replicated
(DDP) or sharded (FSDP2) by ``run.parallel`` (``lmcli.train.parallel``), chosen once: the loop
calls the same methods either way. Rank 0 alone logs; checkpoints are written whole by rank 0
or sharded by every rank (``lmcli.train.sharded``).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmcli import lora
from lmcli.checkpoint import (
    META,
    copy_checkpoint,
    is_sharded,
    last_checkpoint,
    model_from_state,
    model_state,
    read_json,
    step_checkpoints,
)
from lmcli.config import ModelConfig, TrainConfig, resolve_vocab_multiple, to_dict
from lmcli.data.examples import pad_multiple
from lmcli.data.train_data import ExampleData, TrainData, load_train_data
from lmcli.device import (
    Staging,
    autocast,
    autocast_dtype,
    configure_backend,
    deterministic_algorithms,
    set_threads,
    usable_cpus,
)
from lmcli.distributed import Dist, agree_to_stop, in_turn, init_distributed, on_main, shutdown_distributed
from lmcli.downstream.run import describe_scores, load_eval_tasks, task_scores
from lmcli.errors import LmcliError, Terminated
from lmcli.lora_run import base_reference
from lmcli.model import Transformer
from lmcli.safe_io import refuse_symlinks
from lmcli.sources import load_checkpoint
from lmcli.tasks import make_task
from lmcli.train.averaging import EMA
from lmcli.train.init_from import open_init
from lmcli.train.metrics import MetricsLog, plot_loss_curve, plot_task_scores
from lmcli.train.mfu import MfuBasis, flops_per_token, matmul_params, peak_tflops
from lmcli.train.optim import group_lr, lr_at, make_optimizer
from lmcli.train.parallel import (
    Fill,
    Single,
    check_launch,
    choose_parallel,
    clip_grad_norm,
    make_parallel,
    per_process_memory,
)
from lmcli.train.preflight import (
    Preflight,
    available_memory,
    estimate_memory,
    fmt_count,
    fmt_duration,
    measured_memory,
    preflight_rows,
)
from lmcli.train.run_folder import (
    RunFolder,
    absolute_paths,
    check_resumable,
    create_run_dir,
    open_run_dir,
    write_run_config,
)
from lmcli.train.scoring import batch_loss, evaluate_loss, probe_step_seconds
from lmcli.train.sharded import open_sharded
from lmcli.train.state import COUNTERS, RngStates, Stateful, StateRegistry, TrainState, seed_everything
from lmcli.train.tracking import Trackers, open_trackers, require_backends


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    elapsed: float
    stopped: str  # "max_steps", "max_time", "SIGINT", "SIGTERM"


@dataclass
class Reporter:
    """Where the loop's words go; the CLI passes rich-backed callables, tests the defaults."""

    info: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    preflight: Callable[[Preflight, dict[str, str]], None] | None = None
    progress: Any = None  # an object with start(total, step, max_time), update(step, record), stop()


@dataclass
class Marks:
    """Where the loop stands between log points, validations and checkpoints (not saved: a
    resumed run starts them at its step)."""

    running: torch.Tensor  # the summed training loss since the last log point (on the device)
    log_step: int = 0  # the step and time of the last log point
    log_time: float = 0.0
    train_loss: float | None = None  # the last logged training loss
    val_loss: float | None = None  # the last validation loss
    val_step: int = -1  # the step of the last validation
    saved_step: int = -1  # the step of the last checkpoint


@dataclass
class Run:
    """Everything one training run holds, built once by ``open_run``: its options (``cfg``, read
    by section), data and model, the stateful parts (registered once in ``states``, which is
    what a checkpoint saves and a resume restores) and the loop's ``marks``."""

    cfg: TrainConfig
    model_config: ModelConfig
    run_dir: Path
    source: Path | None  # the run folder a resumed run started from (itself, or another: --out)
    data: TrainData
    sampler: Any  # a WindowSampler or an ExampleSampler
    model: Transformer  # what is saved and evaluated (its parameters sharded under FSDP)
    trained: torch.nn.Module  # what runs forward/backward: the model, or its DDP/compiled wrapper
    parallel: Single  # how the processes share the model: one, DDP or FSDP (lmcli.train.parallel)
    device: torch.device
    amp: torch.dtype | None  # the autocast dtype, None for float32
    dist: Dist
    max_steps: int | None
    state: TrainState  # step, data cursor, bests, elapsed time
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    averages: list[EMA]  # weight averages (--ema): updated each step, validated, saved as their own folder
    states: StateRegistry  # the above, and the RNGs: trainer_state.pt
    marks: Marks
    metrics: MetricsLog  # metrics.jsonl: read back for history and the plot
    trackers: Trackers  # where records go as they are made: metrics.jsonl and --log-to's backends
    mfu: MfuBasis
    info: Callable[[str], None]  # rank 0's messages; silent on the other ranks
    staging: Staging | None = None  # batches' copies to a GPU, through reused pinned buffers
    base: dict[str, Any] | None = None  # a LoRA run's base reference (lora_run.base_reference)
    eval_tasks: list[Any] | None = None  # --eval-task files, scored at each validation (lmcli.downstream)

    @property
    def global_batch(self) -> int:
        return self.cfg.optim.batch_size * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:
        return round(self.global_batch * self.cfg.optim.grad_accum * self.data.tokens_per_example())

    def done(self) -> bool:
        return self.max_steps is not None and self.state.step >= self.max_steps


def train(
    model_config: ModelConfig,
    cfg: TrainConfig,
    *,
    resume: str | Path | None = None,
    reporter: Reporter | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a model; with ``resume``, continue the run in that folder exactly where it stopped
    (or, when ``cfg.out`` names another folder, start a new run there from that point).

    The run folder is locked for the whole call; if the call fails before a first checkpoint,
    a folder it created is removed; an interruption says which checkpoint was kept."""
    rep = reporter or Reporter()
    set_threads(cfg.threads)
    check_launch(cfg)
    dist_info, device = init_distributed(cfg.device, group=cfg.parallelism.parallel == "fsdp")
    held: list[RunFolder] = []  # rank 0's locked run folder
    opened: list[Run] = []
    try:
        with deterministic_algorithms(cfg.deterministic):
            with terminate_as_interrupt():  # until fit's own handling: a SIGTERM cleans up as Ctrl-C
                opened.append(open_run(model_config, cfg, resume, rep, progress, dist_info, device, held))
            return fit(opened[0], rep)
    except BaseException as exc:
        if opened:  # the trackers' files closed, W&B's run marked failed
            opened[0].trackers.finish({"step": opened[0].state.step, "stopped": "error"})
        if held:
            after_failure(held[0], opened[0].state.step if opened else None, exc, rep.info)
        raise
    finally:
        if held:
            held[0].release()
        shutdown_distributed()


def after_failure(
    folder: RunFolder, step: int | None, exc: BaseException, info: Callable[[str], None]
) -> None:
    """What a failed or interrupted run leaves: its checkpoints; a folder it made without one goes."""
    kept = None
    for name in ("last", "last.old"):
        if (folder.path / name / META).exists():
            meta = read_json(folder.path / name / META, "checkpoint metadata")
            kept = f"kept {folder.path / name} (step {meta.get('step')})"
            break
    removed = folder.discard()
    if isinstance(exc, KeyboardInterrupt):
        where = f"at step {step}" if step is not None else "before training"
        if kept is None:
            kept = "no checkpoint yet" + (f", removed {folder.path}" if removed else "")
        info(f"interrupted {where}: {kept}")


# ----------------------------------------------------------------------------- the loop


def fit(run: Run, rep: Reporter) -> TrainResult:
    """Train until a limit or a signal, validating and saving as configured; a final checkpoint."""
    cfg, state, marks = run.cfg, run.state, run.marks
    max_time = cfg.schedule.max_time
    clock = Clock(state.elapsed)
    run.trained.train()
    marks.log_step, marks.log_time = state.step, time.time()
    stopped = "max_steps"
    bar = rep.progress if run.dist.is_main else None
    if bar is not None:
        bar.start(run.max_steps, state.step, max_time)
    try:
        with StopSignal() as stop:
            while not run.done():
                timed_out = max_time is not None and clock() >= max_time
                # every rank stops at the same step, and shares one clock (the lr under --max-time)
                elapsed, reason = agree_to_stop(clock(), "max_time" if timed_out else stop.received, run.dist)
                if reason is not None:
                    stopped = reason
                    break
                lr = set_lr(run, elapsed)
                grad_norm = train_step(run)
                state.step += 1
                if state.step % cfg.log_interval == 0 or run.done():
                    log_progress(run, lr, grad_norm, clock, bar)
                improved = False
                if state.step % cfg.validation.eval_interval == 0 or run.done():
                    improved = validate(run)
                # last at every validation, or every --save-interval steps; best whenever it improves
                every = cfg.checkpoint.save_interval
                due = state.step % every == 0 if every else marks.val_step == state.step
                if improved or due:
                    with stop.saving():
                        save(run, clock, improved)
            if marks.saved_step != state.step:  # the final checkpoint, also on a time limit or a signal
                # on a signal, save first: no validation between the user and the checkpoint
                improved = stopped not in SIGNALS and marks.val_step != state.step and validate(run)
                with stop.saving():
                    save(run, clock, improved)
            run.parallel.finish()  # checkpoint writes still under way (sharded: in the background)
    finally:
        if bar is not None:
            bar.stop()
    return finish(run, stopped, clock())


class Clock:
    """Seconds of training: those of earlier sessions (a resumed run's) plus this one's."""

    def __init__(self, before: float) -> None:
        self.before, self.start = before, time.time()

    def __call__(self) -> float:
        return self.before + time.time() - self.start


SIGNALS = ("SIGINT", "SIGTERM")


@contextlib.contextmanager
def terminate_as_interrupt() -> Any:
    """SIGTERM raises ``Terminated`` (a ``KeyboardInterrupt``) in the block: opening a run (its
    data read, SFT conversations rendered) stops as on Ctrl-C, and the folder it made goes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise Terminated

    old = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class StopSignal:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint and stops at the next step. A second
    signal stops at once, except during a save: a save is never cut short (``saving``)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.in_save = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        elif not self.in_save:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def saving(self) -> Any:
        """A block (a save) that a second signal does not interrupt: the loop stops after it."""
        self.in_save = True
        try:
            yield
        finally:
            self.in_save = False

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------- one step


def set_lr(run: Run, elapsed: float) -> float:
    """The schedule's learning rate for this step, set on every parameter group."""
    cfg, max_time = run.cfg, run.cfg.schedule.max_time
    lr = lr_at(run.state.step, cfg, run.max_steps, elapsed / max_time if max_time else 0.0)
    for group in run.optimizer.param_groups:
        group["lr"] = group_lr(group, lr, cfg)
    return lr


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns the gradient norm."""
    optim, state = run.cfg.optim, run.state
    accum, size = optim.grad_accum, optim.batch_size
    for micro in range(accum):
        batch = run.sampler.batch(state.cursor + run.dist.rank * size, size)
        state.cursor += run.global_batch
        with run.parallel.micro_batch(micro == accum - 1), autocast(run.device, run.amp):
            loss = batch_loss(run.trained, batch.to(run.device, run.staging), run.cfg)
        run.scaler.scale(loss / accum).backward()
        run.marks.running += loss.detach() / accum
    run.scaler.unscale_(run.optimizer)
    grad_norm = clip_grad_norm(list(run.model.parameters()), optim.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    for average in run.averages:
        average.update(run.model)
    return grad_norm


def log_progress(run: Run, lr: float, grad_norm: torch.Tensor, clock: Clock, bar: Any) -> None:
    """The mean training loss since the last log point, to metrics.jsonl and the progress bar."""
    step, marks = run.state.step, run.marks
    if run.dist.enabled:  # the global batch's loss, as one process would log it
        torch.distributed.all_reduce(marks.running)
        marks.running /= run.dist.world_size
    marks.train_loss = (marks.running / (step - marks.log_step)).item()  # the one host sync
    marks.running.zero_()
    require_finite(run, marks.train_loss)
    now = time.time()
    record = {
        "step": step,
        "train_loss": marks.train_loss,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": (step - marks.log_step) * run.tokens_per_step / max(now - marks.log_time, 1e-9),
        "elapsed": clock(),
        "epoch": run.sampler.epoch_of(run.state.cursor),
    }
    record["mfu"] = run.mfu.of(record["tokens_per_s"], run.dist.world_size)
    marks.log_step, marks.log_time = step, now
    run.trackers.log(step, record)  # rank 0's; no backend on the others
    if bar is not None:
        bar.update(step, record)


def require_finite(run: Run, loss: float) -> None:
    if not math.isfinite(loss):
        raise LmcliError(
            f"loss became {loss} at or before step {run.state.step}: stopped; the last good "
            f"checkpoint is {run.run_dir / 'last'} (try a lower --lr)"
        )


def validate(run: Run) -> bool:
    """The validation loss (and, for translation, greedy BLEU), logged; True if it is the best."""
    state, cfg = run.state, run.cfg
    loss = run.marks.val_loss = evaluate_loss(run.model, run.data, cfg, run.device, run.amp, run.dist)
    improved = loss < state.best_val
    state.best_val = min(state.best_val, loss)
    run.marks.val_step = state.step
    for average in run.averages:
        average.val_loss = evaluate_loss(average.module, run.data, cfg, run.device, run.amp, run.dist)
    record = validation_record(run, loss) if run.dist.is_main else {}
    if cfg.selected_metric != "val_loss":  # a score rank 0 alone computes: every rank follows it
        improved = run.dist.is_main and select_improved(run, record, loss)
        if run.dist.enabled:
            flag = [improved]
            torch.distributed.broadcast_object_list(flag, src=0, group=run.dist.control)
            improved = flag[0]
    if run.dist.is_main:
        train_loss = run.marks.train_loss if run.marks.train_loss is not None else float("nan")
        scores = "".join(f", {a.label} val loss {a.val_loss:.4f}" for a in run.averages)
        if "val_bleu" in record:
            bleu, chrf = record["val_bleu"], record["val_chrf"]
            scores += f", greedy BLEU {bleu:.2f} chrF {chrf:.2f} ({record['sentences']})"
        scores += describe_scores(record)
        run.info(
            f"step {state.step}: train loss {train_loss:.4f}, val loss {loss:.4f} "
            f"(ppl {math.exp(min(loss, 50)):.2f}){scores}" + (" *best*" if improved else "")
        )
    return improved


def select_improved(run: Run, record: dict[str, Any], loss: float) -> bool:
    """Whether this validation's ``--select`` score (higher is better; equal scores: the lower
    validation loss) beats the best so far. Ties matter: BLEU is 0 for one-word lines."""
    score = record.get(run.cfg.selected_metric)
    if score is None:  # not computed at this validation (--bleu-interval)
        return False
    state = run.state
    if (score, -loss) > (state.best_score, -state.best_score_loss):
        state.best_score, state.best_score_loss = score, loss
        return True
    return False


def validation_record(run: Run, loss: float) -> dict[str, Any]:
    """Rank 0: the validation's scores (greedy BLEU/chrF for translation), logged."""
    state, cfg = run.state, run.cfg
    record: dict[str, Any] = {"step": state.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50))}
    for average in run.averages:
        record[f"val_loss_{average.name}"] = average.val_loss
    task = make_task(cfg)
    if task.wants_bleu(state.step):  # the task's validation BLEU hook
        from lmcli.bleu import greedy_bleu

        with autocast(run.device, run.amp):
            samples, tok = cfg.validation.bleu_samples, run.data.tokenizer
            scores = greedy_bleu(run.model, tok, run.data.val, samples, prefix_lm=task.prefix_lm)
        record.update(val_bleu=scores["bleu"], val_chrf=scores["chrf"])
    record.update(task_scores(run))  # --eval-task: task:NAME:METRIC
    run.trackers.log(state.step, record)
    if "val_bleu" in record:
        record["sentences"] = scores["sentences"]  # for the message, not the metrics file
    return record


def save(run: Run, clock: Clock, improved: bool) -> None:
    """Write ``last`` with every registered part's state (and ``best`` when improved, ``step-N``
    with --keep-last, and each weight average's own folder): every rank calls it, rank 0 (whole
    checkpoints) or every rank (sharded) writes."""
    state, cfg, marks = run.state, run.cfg, run.marks
    # never replace a good checkpoint with diverged weights, even between log points
    require_finite(run, float(marks.running) + (marks.val_loss or 0.0))
    marks.saved_step = state.step
    state.elapsed = clock()
    meta = {
        "step": state.step,
        "val_loss": marks.val_loss,
        "best_val_loss": state.best_val,
        "time": time.time(),
    }
    files = {"cfg": cfg, "tokenizer": run.data.tokenizer}
    for average in run.averages:  # before last/, which holds their state
        own = {**meta, **average.meta()}
        run.parallel.save(run.run_dir / average.name, average.module, meta=own, **files)
    step = state.step

    def copies(last: Path) -> None:  # rank 0, once last/ is in place
        if improved:
            copy_checkpoint(last, run.run_dir / "best")
        if cfg.checkpoint.keep_last and step > 0:
            copy_checkpoint(last, run.run_dir / f"step-{step:07d}")
            for old in step_checkpoints(run.run_dir)[: -cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    last = run.run_dir / "last"
    run.parallel.save(last, run.model, meta=meta, states=run.states, base=run.base, then=copies, **files)


def finish(run: Run, stopped: str, elapsed: float) -> TrainResult:
    """The loss plot and the closing lines; the run's result."""
    state = run.state
    if run.dist.is_main:
        note = plot_loss_curve(run.metrics.read(), run.run_dir / "loss.png")
        plot_task_scores(run.metrics.read(), run.run_dir / "tasks.png")
        if note:
            run.info(f"note: {note}")
        if stopped in SIGNALS:
            run.info(
                f"stopped by {stopped} at step {state.step}: kept {run.run_dir / 'last'} "
                f"(step {run.marks.saved_step}); resume with: lmcli train --resume {run.run_dir}"
            )
        elif stopped == "max_time":
            run.info(
                f"time limit reached at step {state.step}; "
                f"continue with: lmcli train --resume {run.run_dir} --max-time ..."
            )
        run.info(
            f"done in {fmt_duration(elapsed)}: best validation loss {state.best_val:.4f}; "
            f"run folder {run.run_dir}"
        )
    best = state.best_val if math.isfinite(state.best_val) else None
    marks = run.marks
    result = TrainResult(run.run_dir, state.step, marks.train_loss, marks.val_loss, best, elapsed, stopped)
    run.trackers.finish(
        {
            "step": state.step,
            "train_loss": marks.train_loss,
            "val_loss": marks.val_loss,
            "best_val_loss": best,
            "elapsed": elapsed,
            "stopped": stopped,
        }
    )
    return result


# ----------------------------------------------------------------------------- opening a run


def open_run(
    model_config: ModelConfig,
    cfg: TrainConfig,
    resume: str | Path | None,
    rep: Reporter,
    progress: bool,
    dist_info: Dist,
    device: torch.device,
    held: list[RunFolder],
) -> Run:
    """The run folder (locked, into ``held``), data, model, optimizer and state of a new or
    resumed run."""
    configure_backend(device)
    amp = autocast_dtype(device, cfg.dtype)
    info = rep.info if dist_info.is_main else (lambda msg: None)
    require_backends(cfg.trackers)  # before a run folder exists: one line naming what to install
    run_dir, resumed = locate_run(model_config, cfg, resume, dist_info, held)
    cfg = replace(absolute_paths(cfg), out=str(run_dir))
    eval_tasks = load_eval_tasks(cfg) if dist_info.is_main else []  # a bad file stops the run here

    init = None
    if cfg.init_from and not resumed:
        init = open_init(cfg.init_from, info, model_config.block_size)
        model_config = init.config
    base = resumed.base if resumed else base_reference(cfg.init_from) if cfg.lora.lora_rank else None
    tokenizer = resumed.tokenizer if resumed else init.tokenizer if init else None
    data = open_data(cfg, model_config, tokenizer, progress, dist_info, device, info)
    model_config = run_model_config(model_config, cfg, data, resumed, init, device)
    parallel, model, trained, averages = place_model(model_config, cfg, resumed, init, dist_info, device, amp)
    sampler = data.sampler(cfg.optim.batch_size, cfg.seed)
    seed_everything(cfg.seed + dist_info.rank)  # dropout differs per rank, the data never overlaps
    optimizer, scaler, state, states = training_state(model, cfg, amp, dist_info, device, averages)
    if resumed is not None:
        parallel.restore(resumed, model, states)
        into = "" if Path(resume) == run_dir else f" into {run_dir}"
        info(f"resuming {resume} at step {state.step}{into}")

    per_token = training_flops(model, cfg, data)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    in_place = resumed is not None and Path(resume) == run_dir
    trackers = open_trackers(
        cfg.trackers, metrics, run_dir, state.step if in_place else None, dist_info.is_main
    )
    run = Run(
        cfg=cfg,
        model_config=model_config,
        run_dir=run_dir,
        source=Path(resume) if resume is not None else None,
        data=data,
        sampler=sampler,
        model=model,
        trained=trained,
        parallel=parallel,
        device=device,
        amp=amp,
        dist=dist_info,
        max_steps=max_steps_of(cfg, sampler.epoch_size, dist_info.world_size),
        state=state,
        optimizer=optimizer,
        scaler=scaler,
        averages=averages,
        states=states,
        marks=Marks(torch.zeros((), device=device), saved_step=state.step if resumed else -1),
        metrics=metrics,
        trackers=trackers,
        mfu=MfuBasis(per_token, *peak_tflops(device, cfg.peak_tflops)),
        info=info,
        staging=Staging(device),
        base=base,
        eval_tasks=eval_tasks,
    )
    if dist_info.is_main:
        facts = show_preflight(run, rep)
        write_run_config(run_dir, model_config, cfg)
        if resumed:
            carry_history(run)
        trackers.start({"model": to_dict(model_config), "train": to_dict(cfg)}, facts)
    return run


def place_model(
    model_config: ModelConfig,
    cfg: TrainConfig,
    resumed: Any,
    init: Any,
    dist_info: Dist,
    device: torch.device,
    amp: torch.dtype | None,
) -> tuple[Single, Transformer, torch.nn.Module, list[EMA]]:
    """How the processes share the model (``--parallel``, chosen here), the model, what runs
    it (on the device, replicated or sharded, compiled) and its weight averages (``--ema``)."""
    chosen = choose_parallel(cfg, dist_info, *replica_memory(model_config, cfg, amp, device))
    parallel = make_parallel(chosen, cfg, dist_info, device, amp)
    model, fill = build_model(model_config, cfg, resumed, init, meta=parallel.sharded)
    averages = [EMA(model, cfg.optim.ema)] if cfg.optim.ema else []
    trained = parallel.wrap(model, averages, fill)
    return parallel, model, trained, averages


def open_data(
    cfg: TrainConfig,
    model_config: ModelConfig,
    tokenizer: Any,
    progress: bool,
    dist_info: Dist,
    device: torch.device,
    info: Callable[[str], None],
) -> TrainData:
    """The run's training and validation data, tokenized by rank 0 first (the other ranks then
    read its cache)."""
    data = in_turn(
        lambda: load_train_data(
            cfg,
            block_size=model_config.block_size,
            tokenizer=tokenizer,
            progress=progress and dist_info.is_main,
            info=info,
        ),
        dist_info,
    )
    if isinstance(data, ExampleData):  # widths that repeat where shapes are compiled or cached
        data.pad_multiple = pad_multiple(cfg.compile, device)
    return data


def training_state(
    model: Transformer,
    cfg: TrainConfig,
    amp: torch.dtype | None,
    dist_info: Dist,
    device: torch.device,
    averages: list[EMA] = (),  # type: ignore[assignment]
) -> tuple[Any, torch.amp.GradScaler, TrainState, StateRegistry]:
    """The optimizer (of the model as it trains: sharded parameters under FSDP), grad scaler
    and counters of a new run, each registered once, with every rank's RNGs and the weight
    ``averages``, in the ``StateRegistry`` that saves and restores them."""
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)
    state = TrainState()
    parts: dict[str, Stateful] = {
        COUNTERS: state,
        "optimizer": optimizer,
        "scaler": scaler,
        "rng": RngStates(dist_info, device),
    }
    states = StateRegistry({**parts, **{average.name: average for average in averages}})
    return optimizer, scaler, state, states


def carry_history(run: Run) -> None:
    """A resumed run's metrics up to its checkpoint; resumed into a new folder, also the best
    checkpoint so far, copied (the source run folder is only read)."""
    step = run.state.step
    if run.source == run.run_dir:
        run.metrics.truncate_after(step)
        return
    run.metrics.write(
        [r for r in MetricsLog(run.source / "metrics.jsonl").read() if r.get("step", 0) <= step]
    )
    best = run.source / "best"
    if (best / META).exists() and read_json(best / META, "checkpoint metadata").get("step", step + 1) <= step:
        copy_checkpoint(best, run.run_dir / "best", link=False)


def locate_run(
    model_config: ModelConfig,
    cfg: TrainConfig,
    resume: str | Path | None,
    dist_info: Dist,
    held: list[RunFolder],
) -> tuple[Path, Any]:
    """The run folder, created or opened and locked by rank 0 (into ``held``; no other rank races
    its mkdir) and, when resuming, the last checkpoint (with trainer state) it starts from: its
    own, or with ``--out`` another folder's, which is then only read. A sharded checkpoint is
    opened without its weights: they come from the shards (``Single.restore``)."""

    def claim(folder: Callable[[], RunFolder]) -> Path:
        held.append(folder())
        return held[0].path

    if resume is None:
        return on_main(lambda: claim(lambda: create_run_dir(cfg.out)), dist_info), None
    source = Path(resume)
    last_checkpoint(source)  # one line if there is nothing to resume
    refuse_symlinks(source)
    in_place = not cfg.out or Path(cfg.out).resolve() == source.resolve()
    run_dir = on_main(
        lambda: claim(lambda: open_run_dir(source) if in_place else create_run_dir(cfg.out)), dist_info
    )
    ckpt = last_checkpoint(source)
    if is_sharded(ckpt):
        resumed = open_sharded(ckpt, dist_info)
    else:
        resumed = load_checkpoint(ckpt, with_state=True, merge=False)  # adapters kept apart
        if resumed.state is None:
            raise LmcliError(f"{resumed.path} has no trainer state to resume from")
    check_resumable(resumed.model_config, model_config)
    return (source if in_place else run_dir), resumed


def run_model_config(
    model_config: ModelConfig,
    cfg: TrainConfig,
    data: TrainData,
    resumed: Any,
    init: Any,
    device: torch.device,
) -> ModelConfig:
    """The model config a run trains: the resumed run's (with what a resume may change:
    dropout), the imported model's, or a new one's, whose ``--vocab-multiple auto`` becomes a
    number for ``device`` here; the checkpoint records it: the weights' layout never depends on
    the device that later loads them (a resumed or imported model keeps its own)."""
    if resumed is not None:
        saved = resumed.model_config
        free = ModelConfig.on_resume("free")
        return replace(saved, **{name: getattr(model_config, name) for name in free})
    if init is not None:
        return init.config
    model_config = replace(model_config, vocab_size=data.tokenizer.vocab_size)
    return resolve_vocab_multiple(model_config, device.type)


def build_model(
    model_config: ModelConfig, cfg: TrainConfig, resumed: Any, init: Any, *, meta: bool
) -> tuple[Transformer, Fill | None]:
    """The model a run trains, of ``model_config``: resumed, imported (``--init-from``), or new
    and seeded; and, for a model built on the meta device (a sharded checkpoint's, whose
    weights the shards hold; with ``meta``, a Hugging Face folder's), what puts its weights in
    once it is placed (each process its own rows)."""
    if resumed is not None:  # the saved weights, with what a resume may change (dropout)
        changed = model_config != resumed.model_config
        if changed and resumed.base is not None:
            raise LmcliError("a LoRA run resumes with its model options (--dropout) unchanged")
        if resumed.model is None:  # sharded: the shards hold the weights
            return skeleton(model_config, cfg), None
        if changed:
            return model_from_state(model_config, model_state(resumed.model)), None
        return resumed.model, None
    if init is not None:
        model, fill = init.load(meta)
        return (lora.add_adapters(model, cfg) if cfg.lora.lora_rank else model), fill
    seed_everything(cfg.seed)
    return Transformer(model_config), None


def skeleton(model_config: ModelConfig, cfg: TrainConfig) -> Transformer:
    """The run's model on the meta device (LoRA adapters included), for weights put in later."""
    with torch.device("meta"):
        model = Transformer(model_config)
    return lora.add_adapters(model, cfg) if cfg.lora.lora_rank else model


def training_flops(model: Transformer, cfg: TrainConfig, data: TrainData) -> float:
    """Training FLOPs per token (``train/mfu.py``); a LoRA run's frozen weights get no gradient."""
    trained = matmul_params(model, trained_only=True) if cfg.lora.lora_rank else None
    return flops_per_token(model.config, matmul_params(model), round(data.tokens_per_example()), trained)


def max_steps_of(cfg: TrainConfig, windows_per_epoch: int, world_size: int) -> int | None:
    """The step limit: --max-steps, or the steps of --epochs, or the default (None: time only)."""
    sched, optim = cfg.schedule, cfg.optim
    if sched.epochs is not None and sched.max_steps is None:
        per_step = optim.batch_size * world_size * optim.grad_accum
        return math.ceil(sched.epochs * windows_per_epoch / per_step)
    return sched.stop_steps


def replica_memory(
    model_config: ModelConfig, cfg: TrainConfig, amp: torch.dtype | None, device: torch.device
) -> tuple[int, int | None]:
    """Bytes one whole replica of the run needs (the pre-flight's estimate, from the model
    built on the meta device) and what one process has (``--parallel auto`` compares them)."""
    if cfg.parallelism.parallel != "auto":
        return 0, None
    need = estimated_memory(skeleton(model_config, cfg), cfg, amp, device, shards=1)
    return need, per_process_memory(available_memory(device), device)


def estimated_memory(
    model: Transformer,
    cfg: TrainConfig,
    amp: torch.dtype | None,
    device: torch.device,
    shards: int,
    context: int | None = None,
) -> int:
    """The analytic estimate of a process's bytes (no T×T scores where SDPA's flash kernels run),
    with parameters, gradients and optimizer state split over ``shards`` processes, the
    activations ``--activation-checkpointing`` keeps, sequences of ``context`` tokens (None: the
    block size)."""
    flash = device.type == "cuda" and not model.positions.biases_scores and not make_task(cfg).prefix_lm
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params, batch = model.num_parameters(), cfg.optim.batch_size
    recompute = cfg.parallelism.activation_checkpointing
    return estimate_memory(
        model.config,
        params,
        batch,
        amp is not None,
        flash,
        trainable,
        context,
        shards=shards,
        recompute=recompute,
    )


def preflight_memory(run: Run, probed: bool, trainable: int) -> int:
    """Bytes a process needs: on a GPU after a probe step, its measured peak plus the optimizer
    state of what trains; otherwise the analytic estimate (per process: sharded state split)."""
    if probed and run.device.type == "cuda":
        return measured_memory(torch.cuda.max_memory_allocated(run.device), trainable)
    shards = run.dist.world_size if run.parallel.sharded else 1
    longest = run.data.longest_example() if isinstance(run.data, ExampleData) else None
    return estimated_memory(run.model, run.cfg, run.amp, run.device, shards, longest)


def show_preflight(run: Run, rep: Reporter) -> dict[str, str]:
    """One screen of facts before training: size, data, memory and time estimates (returned, for
    the trackers)."""
    cfg, model = run.cfg, run.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    alone = not (cfg.compile or run.parallel.sharded)  # a sharded model steps with every rank
    probe = probe_step_seconds(model, run.sampler, cfg, run.device, run.amp) if alone else None
    pre = Preflight(
        params=model.num_parameters(),
        params_non_embedding=model.num_parameters(non_embedding=True),
        tokens_per_step=run.tokens_per_step,
        train_tokens=run.data.train_tokens,
        val_tokens=run.data.val_tokens,
        max_steps=run.max_steps,
        max_time=cfg.schedule.max_time,
        memory_bytes=preflight_memory(run, probe is not None, trainable),
        available_bytes=per_process_memory(available_memory(run.device), run.device),
        step_seconds=probe * cfg.optim.grad_accum if probe is not None else None,
        processes=run.dist.world_size,
    )
    amp = f"{str(run.amp).removeprefix('torch.')} autocast" if run.amp else "float32"
    facts = {
        "device": f"{run.device}, {amp}",
        "CPU threads": f"{torch.get_num_threads()} (--threads; {usable_cpus()} CPUs usable)",
        "run folder": str(run.run_dir),
        "corpus": str(run.data.info.get("corpus", ""))
        + (" (token cache reused)" if run.data.info.get("cached") else ""),
        "tokenizer": f"{run.data.tokenizer.kind}, {run.data.tokenizer.vocab_size} tokens",
    }
    if run.model_config.padded_vocab_size != run.model_config.vocab_size:
        facts["vocabulary rows"] = (
            f"{run.model_config.padded_vocab_size} (padded to a multiple of "
            f"{run.model_config.vocab_multiple}; outputs keep {run.model_config.vocab_size})"
        )
    if run.dist.enabled or run.parallel.sharded:
        facts["processes"] = run.parallel.describe()
    if cfg.parallelism.activation_checkpointing != "none":
        facts["activation checkpointing"] = f"{cfg.parallelism.activation_checkpointing}, per block"
    if cfg.lora.lora_rank:
        facts["LoRA"] = (
            f"rank {cfg.lora.lora_rank} on {cfg.lora.lora_targets}: {fmt_count(trainable)} trainable "
            "parameters "
            f"({100 * trainable / model.num_parameters():.2f}%)"
        )
    basis = run.mfu
    peak = f"{basis.peak_tflops:.3g} TFLOP/s per device, " if basis.peak_tflops else ""
    facts["MFU against"] = f"{peak}{basis.peak_source}; {basis.flops_per_token / 1e6:.3g} MFLOP/token"
    extra = {label: value for label, value in facts.items() if label != "device"}
    rows = dict(preflight_rows(pre, facts["device"], extra))
    if rep.preflight is not None:
        rep.preflight(pre, facts)
    else:
        run.info(
            f"{fmt_count(pre.params)} parameters, {run.tokens_per_step} tokens/step, "
            f"{run.data.train_tokens} train tokens"
        )
    return rows
