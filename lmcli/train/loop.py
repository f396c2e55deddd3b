"""The training loop, top to bottom: open the run, then step, log, validate and save until done.

``train(model_config, train_config)`` is what ``lmcli train`` calls; tests call it too.
``open_run`` builds everything a run holds (folder, data, model, optimizer, ``TrainState``) into
a ``Run``; ``fit`` is the loop; each thing the loop does is one function of the ``Run``. Under
``torchrun`` it trains with DDP: each rank reads its own slice of every global batch, rank 0
alone logs and writes checkpoints.
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lmcli import lora
from lmcli.checkpoint import (
    META,
    copy_checkpoint,
    last_checkpoint,
    model_from_state,
    model_state,
    read_json,
    save_checkpoint,
    step_checkpoints,
    with_context,
)
from lmcli.config import ModelConfig, TrainConfig, resolve_vocab_multiple
from lmcli.data.examples import pad_multiple
from lmcli.data.train_data import ExampleData, TrainData, load_train_data
from lmcli.device import Staging, autocast, autocast_dtype, configure_backend, deterministic_algorithms
from lmcli.distributed import Dist, agree_to_stop, in_turn, init_distributed, on_main, shutdown_distributed
from lmcli.errors import LmcliError
from lmcli.hf.gguf_load import is_gguf_file, load_gguf
from lmcli.hf.load import is_hf_folder, load_hf_folder
from lmcli.lora_run import base_reference
from lmcli.model import Transformer
from lmcli.safe_io import refuse_symlinks
from lmcli.sources import load_checkpoint
from lmcli.tasks import make_task
from lmcli.train.averaging import EMA
from lmcli.train.metrics import MetricsLog, plot_loss_curve
from lmcli.train.mfu import flops_per_token, matmul_params, mfu, peak_tflops
from lmcli.train.optim import group_lr, lr_at, make_optimizer
from lmcli.train.preflight import (
    Preflight,
    available_memory,
    estimate_memory,
    fmt_count,
    fmt_duration,
    measured_memory,
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
from lmcli.train.state import TrainState, rng_state, seed_everything, set_rng_state


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
class Run:
    """Everything one training run holds, built once by ``open_run``."""

    cfg: TrainConfig
    model_config: ModelConfig
    run_dir: Path
    data: TrainData
    sampler: Any  # a WindowSampler or an ExampleSampler
    model: Transformer  # what is saved and evaluated
    trained: torch.nn.Module  # what runs forward/backward: the model, or its DDP/compiled wrapper
    ddp: Any  # the DistributedDataParallel wrapper, or None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    state: TrainState
    device: torch.device
    amp: torch.dtype | None  # the autocast dtype, None for float32
    dist: Dist
    max_steps: int | None
    metrics: MetricsLog
    info: Callable[[str], None]  # rank 0's messages; silent on the other ranks
    source: Path | None  # the run folder a resumed run started from (itself, or another: --out)
    # since the last log point: the summed loss (on the device), where it started and when
    running: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    staging: Staging | None = None  # batches' copies to a GPU, through reused pinned buffers
    flops_per_token: float = 0.0  # training FLOPs per token (lmcli.train.mfu)
    peak_tflops: float | None = None  # one device's peak, the MFU denominator (None: unknown)
    peak_source: str = ""
    log_step: int = 0
    log_time: float = 0.0
    train_loss: float | None = None  # the last logged training loss
    val_loss: float | None = None  # the last validation loss
    saved_step: int = -1  # the step of the last checkpoint
    val_step: int = -1  # the step of the last validation
    base: dict[str, Any] | None = None  # a LoRA run's base reference (lora_run.base_reference)
    ema: EMA | None = None  # the moving average of the weights (--ema), saved as ema/
    ema_val_loss: float | None = None  # its last validation loss

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:
        return round(self.global_batch * self.cfg.grad_accum * self.data.tokens_per_example())

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
    dist_info, device = init_distributed(cfg.device)
    held: list[RunFolder] = []  # rank 0's locked run folder
    opened: list[Run] = []
    try:
        with deterministic_algorithms(cfg.deterministic):
            opened.append(open_run(model_config, cfg, resume, rep, progress, dist_info, device, held))
            return fit(opened[0], rep)
    except BaseException as exc:
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
    cfg, state = run.cfg, run.state
    clock = Clock(state.elapsed)
    run.trained.train()
    run.log_step, run.log_time = state.step, time.time()
    stopped = "max_steps"
    bar = rep.progress if run.dist.is_main else None
    if bar is not None:
        bar.start(run.max_steps, state.step, cfg.max_time)
    try:
        with StopSignal() as stop:
            while not run.done():
                timed_out = cfg.max_time is not None and clock() >= cfg.max_time
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
                if state.step % cfg.eval_interval == 0 or run.done():
                    improved = validate(run)
                # last at every validation, or every --save-interval steps; best whenever it improves
                due = state.step % cfg.save_interval == 0 if cfg.save_interval else run.val_step == state.step
                if improved or due:
                    with stop.saving():
                        save(run, clock, improved)
            if run.saved_step != state.step:  # the final checkpoint, also on a time limit or a signal
                # on a signal, save first: no validation between the user and the checkpoint
                improved = stopped not in SIGNALS and run.val_step != state.step and validate(run)
                with stop.saving():
                    save(run, clock, improved)
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
    cfg = run.cfg
    lr = lr_at(run.state.step, cfg, run.max_steps, elapsed / cfg.max_time if cfg.max_time else 0.0)
    for group in run.optimizer.param_groups:
        group["lr"] = group_lr(group, lr, cfg)
    return lr


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns the gradient norm."""
    cfg, state = run.cfg, run.state
    for micro in range(cfg.grad_accum):
        batch = run.sampler.batch(state.cursor + run.dist.rank * cfg.batch_size, cfg.batch_size)
        state.cursor += run.global_batch
        # DDP all-reduces gradients only on the last micro-batch of a step
        sync = run.ddp is None or micro == cfg.grad_accum - 1
        with contextlib.nullcontext() if sync else run.ddp.no_sync(), autocast(run.device, run.amp):
            loss = batch_loss(run.trained, batch.to(run.device, run.staging), cfg)
        run.scaler.scale(loss / cfg.grad_accum).backward()
        run.running += loss.detach() / cfg.grad_accum
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        run.ema.update(run.model)
    return grad_norm


def log_progress(run: Run, lr: float, grad_norm: torch.Tensor, clock: Clock, bar: Any) -> None:
    """The mean training loss since the last log point, to metrics.jsonl and the progress bar."""
    step = run.state.step
    if run.dist.enabled:  # the global batch's loss, as one process would log it
        torch.distributed.all_reduce(run.running)
        run.running /= run.dist.world_size
    run.train_loss = (run.running / (step - run.log_step)).item()  # the one host sync
    run.running.zero_()
    require_finite(run, run.train_loss)
    now = time.time()
    record = {
        "step": step,
        "train_loss": run.train_loss,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": (step - run.log_step) * run.tokens_per_step / max(now - run.log_time, 1e-9),
        "elapsed": clock(),
        "epoch": run.sampler.epoch_of(run.state.cursor),
    }
    record["mfu"] = mfu(record["tokens_per_s"], run.flops_per_token, run.peak_tflops, run.dist.world_size)
    run.log_step, run.log_time = step, now
    if run.dist.is_main:
        run.metrics.append(record)
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
    loss = run.val_loss = evaluate_loss(run.model, run.data, cfg, run.device, run.amp, run.dist)
    improved = loss < state.best_val
    state.best_val = min(state.best_val, loss)
    run.val_step = state.step
    if run.ema is not None:
        run.ema_val_loss = evaluate_loss(run.ema.module, run.data, cfg, run.device, run.amp, run.dist)
    record = validation_record(run, loss) if run.dist.is_main else {}
    if cfg.selected_metric != "val_loss":  # a score rank 0 alone computes: every rank follows it
        improved = run.dist.is_main and select_improved(run, record, loss)
        if run.dist.enabled:
            flag = [improved]
            torch.distributed.broadcast_object_list(flag, src=0, group=run.dist.control)
            improved = flag[0]
    if run.dist.is_main:
        train_loss = run.train_loss if run.train_loss is not None else float("nan")
        scores = f", EMA val loss {record['val_loss_ema']:.4f}" if "val_loss_ema" in record else ""
        if "val_bleu" in record:
            bleu, chrf = record["val_bleu"], record["val_chrf"]
            scores += f", greedy BLEU {bleu:.2f} chrF {chrf:.2f} ({record['sentences']})"
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
    if run.ema_val_loss is not None:
        record["val_loss_ema"] = run.ema_val_loss
    task = make_task(cfg)
    if task.wants_bleu(state.step):  # the task's validation BLEU hook
        from lmcli.bleu import greedy_bleu

        with autocast(run.device, run.amp):
            scores = greedy_bleu(
                run.model, run.data.tokenizer, run.data.val, cfg.bleu_samples, prefix_lm=task.prefix_lm
            )
        record.update(val_bleu=scores["bleu"], val_chrf=scores["chrf"])
    run.metrics.append(record)
    if "val_bleu" in record:
        record["sentences"] = scores["sentences"]  # for the message, not the metrics file
    return record


def save(run: Run, clock: Clock, improved: bool) -> None:
    """Write ``last`` (and ``best`` when improved, and ``step-N`` with --keep-last)."""
    state, cfg = run.state, run.cfg
    # never replace a good checkpoint with diverged weights, even between log points
    require_finite(run, float(run.running) + (run.val_loss or 0.0))
    run.saved_step = state.step
    rngs = [rng_state(run.device)]
    if run.dist.enabled:  # every rank takes part in the gather; rank 0 writes
        gathered: list[Any] = [None] * run.dist.world_size
        torch.distributed.all_gather_object(gathered, rngs[0], group=run.dist.control)
        rngs = gathered
    if not run.dist.is_main:
        return
    state.elapsed = clock()
    meta = {
        "step": state.step,
        "val_loss": run.val_loss,
        "best_val_loss": state.best_val,
        "time": time.time(),
    }
    trainer_state = {
        **state.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": rngs,
    }
    if run.ema is not None:
        trainer_state["ema"] = run.ema.state_dict()
        ema_meta = {**meta, "val_loss": run.ema_val_loss, "ema_decay": cfg.ema}
        save_checkpoint(run.run_dir / "ema", run.ema.module, cfg, run.data.tokenizer, meta=ema_meta)
    last = run.run_dir / "last"
    save_checkpoint(last, run.model, cfg, run.data.tokenizer, meta=meta, state=trainer_state, base=run.base)
    if improved:
        copy_checkpoint(last, run.run_dir / "best")
    if cfg.keep_last and state.step > 0:
        copy_checkpoint(last, run.run_dir / f"step-{state.step:07d}")
        for old in step_checkpoints(run.run_dir)[: -cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def finish(run: Run, stopped: str, elapsed: float) -> TrainResult:
    """The loss plot and the closing lines; the run's result."""
    state = run.state
    if run.dist.is_main:
        note = plot_loss_curve(run.metrics.read(), run.run_dir / "loss.png")
        if note:
            run.info(f"note: {note}")
        if stopped in SIGNALS:
            run.info(
                f"stopped by {stopped} at step {state.step}: kept {run.run_dir / 'last'} "
                f"(step {run.saved_step}); resume with: lmcli train --resume {run.run_dir}"
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
    return TrainResult(run.run_dir, state.step, run.train_loss, run.val_loss, best, elapsed, stopped)


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
    run_dir, resumed = locate_run(model_config, cfg, resume, dist_info, held)
    cfg = replace(absolute_paths(cfg), out=str(run_dir))

    init = None
    if cfg.init_from and not resumed:
        init = load_init(cfg.init_from, info, model_config.block_size)
        model_config = init[0].config
    base = resumed.base if resumed else base_reference(cfg.init_from) if cfg.lora_rank else None
    tokenizer = resumed.tokenizer if resumed else init[1] if init else None
    data = in_turn(  # rank 0 fills the token cache first, the other ranks read it
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
    model, model_config = build_model(model_config, cfg, data, resumed, init, device)
    sampler = data.sampler(cfg.batch_size, cfg.seed)
    model.to(device)
    seed_everything(cfg.seed + dist_info.rank)  # dropout differs per rank, the data never overlaps
    optimizer, scaler, state, ema = training_state(model, cfg, amp, resumed, dist_info, device)
    if resumed is not None:
        into = "" if Path(resume) == run_dir else f" into {run_dir}"
        info(f"resuming {resume} at step {state.step}{into}")

    trained, ddp = wrap_for_training(model, cfg, dist_info, device)
    run = Run(
        cfg=cfg,
        model_config=model_config,
        run_dir=run_dir,
        data=data,
        sampler=sampler,
        model=model,
        trained=trained,
        ddp=ddp,
        optimizer=optimizer,
        scaler=scaler,
        state=state,
        device=device,
        amp=amp,
        dist=dist_info,
        max_steps=max_steps_of(cfg, sampler.epoch_size, dist_info.world_size),
        metrics=MetricsLog(run_dir / "metrics.jsonl"),
        info=info,
        source=Path(resume) if resume is not None else None,
        running=torch.zeros((), device=device),
        staging=Staging(device),
        saved_step=state.step if resumed else -1,
        base=base,
        flops_per_token=training_flops(model, cfg, data),
        ema=ema,
    )
    run.peak_tflops, run.peak_source = peak_tflops(device, cfg.peak_tflops)
    if dist_info.is_main:
        show_preflight(run, rep)
        write_run_config(run_dir, model_config, cfg)
        if resumed:
            carry_history(run)
    return run


def training_state(
    model: Transformer,
    cfg: TrainConfig,
    amp: torch.dtype | None,
    resumed: Any,
    dist_info: Dist,
    device: torch.device,
) -> tuple[Any, Any, TrainState, EMA | None]:
    """The optimizer, grad scaler, counters and weight average: new, or a resumed run's."""
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)
    state = TrainState()
    ema = EMA(model, cfg.ema) if cfg.ema else None
    if resumed is not None:
        restore(resumed.state, state, optimizer, scaler, dist_info, cfg, ema, device)
    return optimizer, scaler, state, ema


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
    own, or with ``--out`` another folder's, which is then only read."""

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
    resumed = load_checkpoint(last_checkpoint(source), with_state=True, merge=False)  # adapters kept apart
    if resumed.state is None:
        raise LmcliError(f"{resumed.path} has no trainer state to resume from")
    check_resumable(resumed.model_config, model_config)
    return (source if in_place else run_dir), resumed


def wrap_for_training(
    model: Transformer, cfg: TrainConfig, dist_info: Dist, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """What runs forward and backward: the model, in DDP under torchrun, compiled with --compile."""
    trained: torch.nn.Module = model
    ddp = None
    if dist_info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        # no buffer is trained (position tables are constants): no broadcast before each forward;
        # gradients live in the all-reduce buckets, no copy in and out of them
        trained = ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )
    if cfg.compile:
        trained = torch.compile(trained)
    return trained, ddp


def build_model(
    model_config: ModelConfig,
    cfg: TrainConfig,
    data: TrainData,
    resumed: Any,
    init: Any,
    device: torch.device,
) -> tuple[Transformer, ModelConfig]:
    """The model a run trains: resumed, imported (``--init-from``), or new and seeded. A new
    model's ``--vocab-multiple auto`` becomes a number for ``device`` here, and the checkpoint
    records it: the weights' layout never depends on the device that later loads them (a resumed
    or imported model keeps its own)."""
    if resumed is not None:  # the saved weights, with what a resume may change (dropout)
        saved = resumed.model_config
        free = ModelConfig.on_resume("free")
        wanted = replace(saved, **{name: getattr(model_config, name) for name in free})
        if wanted == saved:
            return resumed.model, saved
        if lora.has_adapters(resumed.model):
            raise LmcliError("a LoRA run resumes with its model options (--dropout) unchanged")
        return model_from_state(wanted, model_state(resumed.model)), wanted
    if init is not None:
        return (lora.add_adapters(init[0], cfg) if cfg.lora_rank else init[0]), init[0].config
    model_config = replace(model_config, vocab_size=data.tokenizer.vocab_size)
    model_config = resolve_vocab_multiple(model_config, device.type)
    seed_everything(cfg.seed)
    return Transformer(model_config), model_config


def training_flops(model: Transformer, cfg: TrainConfig, data: TrainData) -> float:
    """Training FLOPs per token (``train/mfu.py``); a LoRA run's frozen weights get no gradient."""
    trained = matmul_params(model, trained_only=True) if cfg.lora_rank else None
    return flops_per_token(model.config, matmul_params(model), round(data.tokens_per_example()), trained)


def load_init(
    path: str, info: Callable[[str], None], block_size: int | None = None
) -> tuple[Transformer, Any]:
    """The model and tokenizer ``--init-from`` names: a Hugging Face folder, a GGUF file or an
    lmcli run or checkpoint folder (a LoRA run's adapters merged), in float32 as every model
    trains. ``block_size`` below its context cuts it (the run trains and stores that context);
    above it, the model keeps its own, and ``info`` says so."""
    if is_gguf_file(path):
        model, tok, _ = load_gguf(path, torch.float32)
    elif is_hf_folder(path) or not Path(path).is_dir():
        model, tok = load_hf_folder(path, torch.float32, info)
    else:
        ckpt = load_checkpoint(path)
        model, tok = ckpt.model.float(), ckpt.tokenizer
    context = model.config.block_size
    if block_size is not None and block_size < context:
        model = with_context(model, block_size)
    elif block_size is not None and block_size > context:
        info(f"note: {path} has a context of {context} tokens: block size {context}, not {block_size}")
    return model, tok


def max_steps_of(cfg: TrainConfig, windows_per_epoch: int, world_size: int) -> int | None:
    """The step limit: --max-steps, or the steps of --epochs, or the default (None: time only)."""
    if cfg.epochs is not None and cfg.max_steps is None:
        return math.ceil(cfg.epochs * windows_per_epoch / (cfg.batch_size * world_size * cfg.grad_accum))
    return cfg.stop_steps


def restore(
    saved: dict[str, Any],
    state: TrainState,
    optimizer: Any,
    scaler: Any,
    dist_info: Dist,
    cfg: TrainConfig,
    ema: EMA | None,
    device: torch.device | None = None,
) -> None:
    """A resumed run's counters, optimizer, scaler, weight average and this rank's RNG states
    (its GPU's only)."""
    was = "muon" if "muon" in saved["optimizer"] else "adamw"
    if was != cfg.optimizer_kind:
        raise LmcliError(
            f"cannot resume a run trained with --optimizer {was} with --optimizer {cfg.optimizer_kind}"
        )
    state.load_state_dict(saved)
    optimizer.load_state_dict(saved["optimizer"])
    if ema is not None and "ema" in saved:  # else (--ema added on resume) it starts from here
        ema.load_state_dict(saved["ema"])
    # a run saved without a scaler (bf16, float32) has an empty state: a float16 resume starts
    # a fresh scale; a float16 run resumed in bf16 ignores its scale
    if saved.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(saved["scaler"])
    rngs = saved["rng"]
    if dist_info.rank < len(rngs):  # a rank the saved run did not have keeps its own seed
        set_rng_state(rngs[dist_info.rank], device)


def preflight_memory(run: Run, probed: bool, trainable: int) -> int:
    """Bytes the run needs: on a GPU after a probe step, its measured peak plus the optimizer
    state of what trains; otherwise the analytic estimate (no T×T scores where SDPA's flash
    kernels run)."""
    if probed and run.device.type == "cuda":
        return measured_memory(torch.cuda.max_memory_allocated(run.device), trainable)
    flash = (
        run.device.type == "cuda"
        and not run.model.positions.biases_scores
        and not make_task(run.cfg).prefix_lm
    )
    params = run.model.num_parameters()
    longest = run.data.longest_example() if isinstance(run.data, ExampleData) else None
    return estimate_memory(
        run.model_config, params, run.cfg.batch_size, run.amp is not None, flash, trainable, longest
    )


def show_preflight(run: Run, rep: Reporter) -> None:
    """One screen of facts before training: size, data, memory and time estimates."""
    cfg, model = run.cfg, run.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    probe = None if cfg.compile else probe_step_seconds(model, run.sampler, cfg, run.device, run.amp)
    pre = Preflight(
        params=model.num_parameters(),
        params_non_embedding=model.num_parameters(non_embedding=True),
        tokens_per_step=run.tokens_per_step,
        train_tokens=run.data.train_tokens,
        val_tokens=run.data.val_tokens,
        max_steps=run.max_steps,
        max_time=cfg.max_time,
        memory_bytes=preflight_memory(run, probe is not None, trainable),
        available_bytes=available_memory(run.device),
        step_seconds=probe * cfg.grad_accum if probe is not None else None,
    )
    amp = f"{str(run.amp).removeprefix('torch.')} autocast" if run.amp else "float32"
    facts = {
        "device": f"{run.device}, {amp}",
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
    if run.dist.enabled:
        facts["processes"] = f"{run.dist.world_size} (DDP)"
    if cfg.lora_rank:
        facts["LoRA"] = (
            f"rank {cfg.lora_rank} on {cfg.lora_targets}: {fmt_count(trainable)} trainable parameters "
            f"({100 * trainable / model.num_parameters():.2f}%)"
        )
    peak = f"{run.peak_tflops:.3g} TFLOP/s per device, " if run.peak_tflops else ""
    facts["MFU against"] = f"{peak}{run.peak_source}; {run.flops_per_token / 1e6:.3g} MFLOP/token"
    if rep.preflight is not None:
        rep.preflight(pre, facts)
    else:
        run.info(
            f"{fmt_count(pre.params)} parameters, {run.tokens_per_step} tokens/step, "
            f"{run.data.train_tokens} train tokens"
        )
