"""The training loop, top to bottom: open the run, then step, log, validate and save until done.

``train(model_config, train_config)`` is what ``lmcli train`` calls; tests call it too.
``open_run`` builds everything a run holds (folder, data, model, optimizer, ``TrainState``) into
a ``Run``; ``fit`` is the loop; each thing the loop does is one function of the ``Run``. What a
step and a validation are is the task's ``run.method`` (``train.run.Method``: next-token
prediction, DPO, GRPO), asked the same way whatever it is: the loop never asks which. Under
``torchrun`` each rank reads its own slice of every global batch and the model is replicated
(DDP) or sharded (FSDP2) by ``run.parallel`` (``lmcli.train.parallel``), chosen once: the loop
calls the same methods either way. Rank 0 alone logs; checkpoints are written whole by rank 0
or sharded by every rank (``lmcli.train.sharded``).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.device import (
    autocast,
    deterministic_algorithms,
    set_threads,
)
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    META,
    copy_checkpoint,
    read_json,
    step_checkpoints,
)
from lmcli.tasks import make_task
from lmcli.train.distributed import (
    agree_to_stop,
    init_distributed,
    shutdown_distributed,
)
from lmcli.train.losses import evaluate_loss
from lmcli.train.metrics import plot_loss_curve, plot_task_scores
from lmcli.train.optim import group_lr, lr_at
from lmcli.train.parallel import (
    check_launch,
    clip_grad_norm,
)
from lmcli.train.preflight import (
    fmt_duration,
)
from lmcli.train.run import Reporter, Run, TrainResult
from lmcli.train.run_folder import (
    RunFolder,
)
from lmcli.train.setup import open_run
from lmcli.train.sharded import Contents
from lmcli.train.signals import SIGNALS, Clock, StopSignal, terminate_as_interrupt
from lmcli.train.task_scores import describe_scores, task_scores

T = TypeVar("T")
_NOTHING: Any = object()  # the end of an iterator, for ``marked_last``


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
    closing = contextlib.ExitStack()  # what the run starts beside this process (reward workers)
    try:
        with deterministic_algorithms(cfg.deterministic):
            with terminate_as_interrupt():  # until fit's own handling: a SIGTERM cleans up as Ctrl-C
                run = open_run(model_config, cfg, resume, rep, progress, dist_info, device, held, closing)
                opened.append(run)
            return fit(opened[0], rep)
    except BaseException as exc:
        if opened:  # the trackers' files closed, W&B's run marked failed
            opened[0].trackers.finish({"step": opened[0].state.step, "stopped": "error"})
        if held:
            after_failure(held[0], opened[0].state.step if opened else None, exc, rep.info)
        raise
    finally:
        closing.close()
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
    if run.method.baseline and state.step == 0:
        baseline(run)
    if bar is not None:
        bar.start(run.max_steps, state.step, max_time, run.method.shown)
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


# ----------------------------------------------------------------------------- one step


def set_lr(run: Run, elapsed: float) -> float:
    """The schedule's learning rate for this step, set on every parameter group."""
    cfg, max_time = run.cfg, run.cfg.schedule.max_time
    lr = lr_at(run.state.step, cfg, run.max_steps, elapsed / max_time if max_time else 0.0)
    for group in run.optimizer.param_groups:
        group["lr"] = group_lr(group, lr, cfg)
    return lr


def train_step(run: Run) -> torch.Tensor:
    """One step: ``passes`` optimizer steps over the method's micro-batches (``Method``: their
    loss, or a grpo step's replies sampled and rewarded first); returns the gradient norm."""
    method = run.method
    micro_batches = method.micro_batches(run)
    grad_norm = torch.zeros(())
    for _ in range(method.passes):
        for last, batch in marked_last(micro_batches):
            with run.parallel.micro_batch(last), autocast(run.device, run.amp):
                share = method.loss(run.trained, batch)
            run.scaler.scale(share).backward()
            run.marks.running += share.detach() / method.passes
        grad_norm = optimizer_step(run)
    return grad_norm


def marked_last(items: Iterable[T]) -> Iterator[tuple[bool, T]]:
    """``(is_last, item)`` for each item, read one ahead (the last micro-batch of a step is the
    one whose backward synchronizes gradients across processes)."""
    it = iter(items)
    current = next(it, _NOTHING)
    while current is not _NOTHING:
        following = next(it, _NOTHING)
        yield following is _NOTHING, current  # type: ignore[misc]
        current = following


def optimizer_step(run: Run) -> torch.Tensor:
    """The optimizer's step on the gradients gathered (unscaled, clipped); the gradient norm."""
    optim = run.cfg.optim
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
    record.update(run.method.logged())  # dpo: rewards, margin, accuracy; grpo: rewards, spread, KL
    marks.log_step, marks.log_time = step, now
    run.trackers.log(step, record)  # rank 0's; no backend on the others
    if bar is not None:
        bar.update(step, record)


def require_finite(run: Run, loss: float) -> None:
    """Stop a run whose loss is no longer a number, naming the checkpoint it keeps (if any)."""
    if not math.isfinite(loss):
        last = run.run_dir / "last"
        kept = (
            f"the last good checkpoint is {last}"
            if (last / META).exists()
            else "no checkpoint was written before it"
        )
        raise LmcliError(
            f"loss became {loss} at or before step {run.state.step}: stopped; {kept} (a learning "
            "rate too high is the usual cause: try a lower --lr)"
        )


def validate(run: Run) -> bool:
    """The method's validation (and, for translation, greedy BLEU), logged; True if it is the best."""
    state, cfg = run.state, run.cfg
    loss, scores = run.method.validate(run)
    run.marks.val_loss = loss
    improved = loss < state.best_val
    state.best_val = min(state.best_val, loss)
    run.marks.val_step = state.step
    for average in run.averages:
        average.val_loss = evaluate_loss(average.module, run.data, cfg, run.device, run.amp, run.dist)
    record = validation_record(run, scores) if run.dist.is_main else {}
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
            f"step {state.step}: train loss {train_loss:.4f}, {describe_validation(run, record)}"
            f"{scores}" + (" *best*" if improved else "")
        )
    return improved


def baseline(run: Run) -> None:
    """The starting model's validation, logged at step 0 (grpo: what the run is to improve on);
    it sets no best."""
    _, scores = run.method.validate(run)
    if run.dist.is_main:
        run.trackers.log(0, {"step": 0, **scores})
        run.info(f"step 0 (the starting model): {describe_validation(run, scores)}")


def describe_validation(run: Run, record: dict[str, Any]) -> str:
    """A validation in words: its loss and perplexity, or a post-training task's scores."""
    return run.method.summary(record)


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


def validation_record(run: Run, scores: dict[str, float]) -> dict[str, Any]:
    """Rank 0: the validation's record: the method's ``scores`` (a loss and its perplexity; dpo:
    its loss, accuracy and margin; grpo: the reward), greedy BLEU/chrF for translation, logged."""
    state, cfg = run.state, run.cfg
    record: dict[str, Any] = {"step": state.step, **scores}
    for average in run.averages:
        record[f"val_loss_{average.name}"] = average.val_loss
    task = make_task(cfg)
    if task.wants_bleu(state.step):  # the task's validation BLEU hook
        from lmcli.eval.bleu import greedy_bleu

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
    tokenizer = run.data.tokenizer
    for average in run.averages:  # before last/, which holds their state
        own = Contents(cfg, tokenizer, meta={**meta, **average.meta()})
        run.parallel.save(run.run_dir / average.name, average.module, own)
    step = state.step

    def copies(last: Path) -> None:  # rank 0, once last/ is in place
        if improved:
            copy_checkpoint(last, run.run_dir / "best")
        if cfg.checkpoint.keep_last and step > 0:
            copy_checkpoint(last, run.run_dir / f"step-{step:07d}")
            for old in step_checkpoints(run.run_dir)[: -cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    last = run.run_dir / "last"
    contents = Contents(cfg, tokenizer, meta, states=run.states, base=run.base, then=copies)
    run.parallel.save(last, run.model, contents)


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
        best_text = run.method.best(state.best_val)
        run.info(f"done in {fmt_duration(elapsed)}: {best_text}; run folder {run.run_dir}")
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
