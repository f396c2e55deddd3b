"""The training loop: data, AdamW with warmup + cosine decay, evaluation, checkpoints, resume.

``train(model_config, train_config)`` is what ``lmcli train`` calls; tests call it too.
Under ``torchrun`` it trains with DDP: each rank reads its own slice of every global batch,
rank 0 alone logs and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmcli.checkpoint import (
    copy_checkpoint,
    last_checkpoint,
    load_checkpoint,
    read_json,
    save_checkpoint,
)
from lmcli.config import ModelConfig, TrainConfig, from_dict, parse_duration, split_options, to_dict
from lmcli.data import IGNORE, Batch
from lmcli.errors import LmcliError
from lmcli.metrics import MetricsLog, plot_loss_curve
from lmcli.model import Transformer
from lmcli.preflight import Preflight, available_memory, estimate_memory, fmt_count, fmt_duration
from lmcli.prepare import TrainData, prepare_data
from lmcli.runtime import (
    Dist,
    agree_to_stop,
    autocast,
    autocast_dtype,
    configure_backend,
    in_turn,
    init_distributed,
    on_main,
    rng_state,
    seed_everything,
    set_rng_state,
    shutdown_distributed,
)

SHAPE_FIELDS = (
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
    "d_ff",
    "position",
    "mlp",
    "norm",
    "norm_placement",
    "tie_embeddings",
    "bias",
    "vocab_size",
)


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


# ----------------------------------------------------------------------------- optimization


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (linear and embedding weights) only, not on biases/norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **extra)


def lr_at(step: int, cfg: TrainConfig, max_steps: int | None, time_fraction: float = 0.0) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the end of the run.

    The end is ``max_steps``; a run limited only by ``--max-time`` decays over the time budget.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if max_steps is not None:
        span = max(max_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
    else:
        progress = min(max(time_fraction, 0.0), 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - floor)


def forward_scored(
    model: torch.nn.Module, batch: Batch, cfg: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, V) and targets (N,) of the positions the loss reads.

    Language modelling scores every position; translation only target tokens, so the vocabulary
    projection skips source and padding positions.
    """
    prefix = batch.prefix_len if cfg.prefix_lm else None
    if cfg.task == "translation":
        mask = batch.y != IGNORE
        return model(batch.x, prefix_len=prefix, output_mask=mask), batch.y[mask]
    logits = model(batch.x, prefix_len=prefix)
    return logits.view(-1, logits.size(-1)), batch.y.reshape(-1)


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    data: TrainData,
    cfg: TrainConfig,
    device: torch.device,
    amp: torch.dtype | None,
    dist_info: Dist,
) -> float:
    """Mean validation loss (nats per scored token) over a fixed validation set, across ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of NLL, scored tokens)
    limit = cfg.eval_batches * cfg.batch_size * dist_info.world_size  # the same windows at any world size
    for batch in data.val_batches(cfg.batch_size, limit, dist_info.rank, dist_info.world_size):
        with autocast(device, amp):
            logits, targets = forward_scored(model, batch.to(device), cfg)
        nll = F.cross_entropy(logits.float(), targets, reduction="sum")
        total += torch.stack(
            [nll.double(), torch.tensor(targets.numel(), dtype=torch.float64, device=device)]
        )
    if dist_info.enabled:
        torch.distributed.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


def wants_bleu(cfg: TrainConfig, step: int) -> bool:
    """Whether this validation also decodes validation pairs for BLEU (translation only)."""
    if cfg.task != "translation" or not cfg.bleu_samples:
        return False
    return not cfg.bleu_interval or step % cfg.bleu_interval == 0


# ----------------------------------------------------------------------------- run folders


def default_run_dir() -> Path:
    return Path("checkpoints") / datetime.now().strftime("run-%Y%m%d-%H%M%S")


def check_writable(path: Path) -> None:
    """Fail early, before any work, if the run folder cannot be created and written."""
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LmcliError(f"cannot create output folder {path}: {parent} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".lmcli-write-test-"):
            pass
    except OSError as exc:
        raise LmcliError(f"cannot write to output folder {path}: {exc.strerror}") from None


def new_run_dir(cfg: TrainConfig) -> Path:
    """The folder a new run writes to: ``--out`` or a timestamped default, empty and writable."""
    run_dir = Path(cfg.out) if cfg.out else default_run_dir()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise LmcliError(
            f"{run_dir} already holds files: resume with --resume {run_dir} or pick another --out"
        )
    check_writable(run_dir)
    return run_dir


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Local paths made absolute, so the stored config works from any folder (resume, eval)."""

    def fix(p: str | None) -> str | None:
        if p is None or os.path.isabs(p):
            return p
        if Path(p).exists() or glob.has_magic(p):
            return str(Path.cwd() / p)
        return p

    return replace(
        cfg,
        corpus=tuple(fix(c) or c for c in cfg.corpus),
        **{
            k: fix(getattr(cfg, k))
            for k in (
                "dataset",
                "source",
                "target",
                "val",
                "val_source",
                "val_target",
                "cache_dir",
                "init_from",
            )
        },
        tokenizer=fix(cfg.tokenizer) if cfg.tokenizer not in ("char", "byte", "bpe") else cfg.tokenizer,
    )


def check_resumable(saved: ModelConfig, requested: ModelConfig) -> None:
    """Resuming may change run length and the like, never the model's shape."""
    changed = [f for f in SHAPE_FIELDS if f != "vocab_size" and getattr(saved, f) != getattr(requested, f)]
    if changed:
        what = ", ".join(
            f"{f.replace('_', '-')} {getattr(saved, f)} -> {getattr(requested, f)}" for f in changed
        )
        raise LmcliError(f"cannot resume with a different model shape ({what})")


def resolve_configs(
    file_options: dict[str, Any], cli_options: dict[str, Any], *, resume: str | Path | None = None
) -> tuple[ModelConfig, TrainConfig]:
    """Configs from dataclass defaults < the resumed run's config < a config file < CLI flags."""
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    if resume is not None:
        saved = read_json(last_checkpoint(resume) / "config.json", "run config")
        model, train = dict(saved.get("model", {})), dict(saved.get("train", {}))
    for source, options in (("config file", file_options), ("options", cli_options)):
        m, t = split_options(options, source=source)
        model.update(m)
        train.update(t)
    if train.get("task") == "translation" and "tokenizer" not in train:
        train["tokenizer"] = "bpe"  # a joint subword vocabulary over both languages
    if "max_time" in train and train["max_time"] is not None:
        train["max_time"] = parse_duration(train["max_time"])
    return from_dict(ModelConfig, model, source="model config"), from_dict(
        TrainConfig, train, source="train config"
    )


# ----------------------------------------------------------------------------- the loop


class _StopSignal:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint and stops at the next step."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        if threading_main():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def train(
    model_config: ModelConfig,
    cfg: TrainConfig,
    *,
    resume: str | Path | None = None,
    reporter: Reporter | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a model; with ``resume``, continue the run in that folder exactly where it stopped."""
    rep = reporter or Reporter()
    dist_info, device = init_distributed(cfg.device)
    try:
        return _train(model_config, cfg, resume, rep, progress, dist_info, device)
    finally:
        shutdown_distributed()


def _train(
    model_config: ModelConfig,
    cfg: TrainConfig,
    resume: str | Path | None,
    rep: Reporter,
    progress: bool,
    dist_info: Dist,
    device: torch.device,
) -> TrainResult:
    configure_backend(device)
    amp = autocast_dtype(device, cfg.dtype)
    info = rep.info if dist_info.is_main else (lambda msg: None)

    # --- where the run lives, and what it resumes from
    state: dict[str, Any] | None = None
    resumed = None
    if resume is not None:
        run_dir = Path(resume)
        resumed = load_checkpoint(last_checkpoint(run_dir), with_state=True)
        if resumed.state is None:
            raise LmcliError(f"{resumed.path} has no trainer state to resume from")
        check_resumable(resumed.model_config, model_config)
        state = resumed.state
    else:
        run_dir = on_main(lambda: new_run_dir(cfg), dist_info)  # rank 0's name; no rank races its mkdir
    cfg = replace(absolute_paths(cfg), out=str(run_dir))

    # --- data and model
    data = in_turn(  # rank 0 fills the token cache first, the other ranks read it
        lambda: prepare_data(
            cfg,
            block_size=model_config.block_size,
            tokenizer=resumed.tokenizer if resumed else None,
            progress=progress and dist_info.is_main,
            info=info,
        ),
        dist_info,
    )
    if cfg.init_from and not resumed:
        from lmcli.hf import from_hf_gpt2

        model, tokenizer = from_hf_gpt2(cfg.init_from)
        model_config = model.config
        if tokenizer.fingerprint != data.tokenizer.fingerprint:
            data = in_turn(
                lambda: prepare_data(
                    cfg,
                    block_size=model_config.block_size,
                    tokenizer=tokenizer,
                    progress=progress and dist_info.is_main,
                    info=info,
                ),
                dist_info,
            )
    elif resumed:
        model, model_config = resumed.model, resumed.model_config
    else:
        model_config = replace(model_config, vocab_size=data.tokenizer.vocab_size)
        seed_everything(cfg.seed)
        model = Transformer(model_config)
    sampler = data.sampler(cfg.batch_size, cfg.seed)
    model.to(device)
    seed_everything(cfg.seed + dist_info.rank)  # dropout differs per rank, the data never overlaps

    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)
    global_batch = cfg.batch_size * dist_info.world_size
    if cfg.epochs is not None and cfg.max_steps is None:
        max_steps: int | None = math.ceil(cfg.epochs * sampler.n_windows / (global_batch * cfg.grad_accum))
    else:
        max_steps = cfg.stop_steps

    step, cursor, best_val, elapsed_before = 0, 0, math.inf, 0.0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        step, cursor = int(state["step"]), int(state["cursor"])
        best_val = float(state.get("best_val", math.inf))
        elapsed_before = float(state.get("elapsed", 0.0))
        rngs = state["rng"]
        if dist_info.rank < len(rngs):  # a rank the saved run did not have keeps its own seed
            set_rng_state(rngs[dist_info.rank])
        info(f"resuming {run_dir} at step {step}")

    raw_model = model  # what is saved and evaluated: no DDP or compile wrapper
    ddp = None
    if dist_info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        model = ddp = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if cfg.compile:
        model = torch.compile(model)

    # --- pre-flight screen
    tokens_per_step = round(global_batch * cfg.grad_accum * data.tokens_per_example())
    if dist_info.is_main:
        probe = None if cfg.compile else _probe_step_seconds(raw_model, sampler, cfg, device, amp)
        pre = Preflight(
            params=raw_model.num_parameters(),
            params_non_embedding=raw_model.num_parameters(non_embedding=True),
            tokens_per_step=tokens_per_step,
            train_tokens=data.train_tokens,
            val_tokens=data.val_tokens,
            max_steps=max_steps,
            max_time=cfg.max_time,
            memory_bytes=estimate_memory(
                model_config, raw_model.num_parameters(), cfg.batch_size, amp is not None
            ),
            available_bytes=available_memory(device),
            step_seconds=probe * cfg.grad_accum if probe is not None else None,
        )
        facts = {
            "device": f"{device}, " + (f"{str(amp).removeprefix('torch.')} autocast" if amp else "float32"),
            "run folder": str(run_dir),
            "corpus": str(data.info.get("corpus", ""))
            + (" (token cache reused)" if data.info.get("cached") else ""),
            "tokenizer": f"{data.tokenizer.kind}, {data.tokenizer.vocab_size} tokens",
        }
        if dist_info.enabled:
            facts["processes"] = f"{dist_info.world_size} (DDP)"
        if rep.preflight is not None:
            rep.preflight(pre, facts)
        else:
            info(
                f"{fmt_count(pre.params)} parameters, {tokens_per_step} tokens/step, "
                f"{data.train_tokens} train tokens"
            )

    # --- the run folder exists from here on
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    created = not run_dir.exists()
    if dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_config(run_dir, model_config, cfg)
        if resumed:
            metrics.truncate_after(step)

    saved_step = step if resumed else -1

    def require_finite(loss: float) -> None:
        if not math.isfinite(loss):
            raise LmcliError(
                f"loss became {loss} at or before step {step}: stopped; the last good "
                f"checkpoint is {run_dir / 'last'} (try a lower --lr)"
            )

    def save(improved: bool, val_loss: float | None) -> None:
        """Write ``last`` (and ``best`` when improved, and ``step-N`` with --keep-last)."""
        nonlocal saved_step
        # never replace a good checkpoint with diverged weights, even between log points
        require_finite(float(running) + (val_loss or 0.0))
        saved_step = step
        rngs = [rng_state()]
        if dist_info.enabled:  # every rank takes part in the gather; rank 0 writes
            gathered: list[Any] = [None] * dist_info.world_size
            torch.distributed.all_gather_object(gathered, rngs[0], group=dist_info.control)
            rngs = gathered
        if not dist_info.is_main:
            return
        meta = {"step": step, "val_loss": val_loss, "best_val_loss": best_val, "time": time.time()}
        trainer_state = {
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "step": step,
            "cursor": cursor,
            "best_val": best_val,
            "elapsed": elapsed_before + (time.time() - t_start),
            "rng": rngs,
        }
        save_checkpoint(run_dir / "last", raw_model, cfg, data.tokenizer, meta=meta, state=trainer_state)
        if improved:
            copy_checkpoint(run_dir / "last", run_dir / "best")
        if cfg.keep_last and step > 0:
            copy_checkpoint(run_dir / "last", run_dir / f"step-{step:07d}")
            for old in sorted(run_dir.glob("step-*"))[: -cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def validate() -> tuple[float, bool]:
        nonlocal best_val
        loss = evaluate_loss(raw_model, data, cfg, device, amp, dist_info)
        improved = loss < best_val
        best_val = min(best_val, loss)
        if dist_info.is_main:
            record = {"step": step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50))}
            bleu = ""
            if wants_bleu(cfg, step):
                from lmcli.bleu import greedy_bleu

                with autocast(device, amp):
                    scores = greedy_bleu(
                        raw_model, data.tokenizer, data.val, cfg.bleu_samples, prefix_lm=cfg.prefix_lm
                    )
                record.update(val_bleu=scores["bleu"], val_chrf=scores["chrf"])
                bleu = f", greedy BLEU {scores['bleu']:.2f} chrF {scores['chrf']:.2f} ({scores['sentences']})"
            metrics.append(record)
            info(
                f"step {step}: train loss {train_loss if train_loss is not None else float('nan'):.4f}, "
                f"val loss {loss:.4f} (ppl {math.exp(min(loss, 50)):.2f}){bleu}"
                + (" *best*" if improved else "")
            )
        return loss, improved

    # --- the loop
    model.train()
    t_start = time.time()
    last_log_t, last_log_step = t_start, step
    train_loss: float | None = None
    val_loss: float | None = None
    running = torch.zeros((), device=device)
    stopped = "max_steps"
    bar = rep.progress if dist_info.is_main else None
    if bar is not None:
        bar.start(max_steps, step, cfg.max_time)
    try:
        with _StopSignal() as stop:
            while True:
                elapsed = elapsed_before + (time.time() - t_start)
                if max_steps is not None and step >= max_steps:
                    break
                timed_out = cfg.max_time is not None and elapsed >= cfg.max_time
                # every rank stops at the same step, and shares one clock (the lr under --max-time)
                elapsed, reason = agree_to_stop(
                    elapsed, "max_time" if timed_out else stop.received, dist_info
                )
                if reason is not None:
                    stopped = reason
                    break
                lr = lr_at(step, cfg, max_steps, elapsed / cfg.max_time if cfg.max_time else 0.0)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for micro in range(cfg.grad_accum):
                    batch = sampler.batch(cursor + dist_info.rank * cfg.batch_size, cfg.batch_size).to(device)
                    cursor += global_batch
                    # DDP all-reduces gradients only on the last micro-batch of a step
                    sync = ddp is None or micro == cfg.grad_accum - 1
                    with contextlib.nullcontext() if sync else ddp.no_sync(), autocast(device, amp):
                        logits, targets = forward_scored(model, batch, cfg)
                        loss = F.cross_entropy(logits.float(), targets, label_smoothing=cfg.label_smoothing)
                    scaler.scale(loss / cfg.grad_accum).backward()
                    running += loss.detach() / cfg.grad_accum
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1

                last = max_steps is not None and step >= max_steps
                if step % cfg.log_interval == 0 or last:
                    if dist_info.enabled:  # the global batch's loss, as one process would log it
                        torch.distributed.all_reduce(running)
                        running /= dist_info.world_size
                    train_loss = (running / (step - last_log_step)).item()  # the one host sync
                    running.zero_()
                    require_finite(train_loss)
                    now = time.time()
                    record = {
                        "step": step,
                        "train_loss": train_loss,
                        "lr": lr,
                        "grad_norm": float(grad_norm),
                        "tokens_per_s": (step - last_log_step)
                        * tokens_per_step
                        / max(now - last_log_t, 1e-9),
                        "elapsed": elapsed_before + now - t_start,
                        "epoch": sampler.epoch_of(cursor),
                    }
                    last_log_t, last_log_step = now, step
                    if dist_info.is_main:
                        metrics.append(record)
                    if bar is not None:
                        bar.update(step, record)
                if step % cfg.eval_interval == 0 or last:
                    val_loss, improved = validate()
                    if not cfg.save_interval:
                        save(improved, val_loss)
                if cfg.save_interval and step % cfg.save_interval == 0:
                    save(False, val_loss)
        # the final checkpoint, also on a time limit or a signal
        if saved_step != step:
            val_loss, improved = validate()
            save(improved, val_loss)
    except BaseException:
        if dist_info.is_main and created and not (run_dir / "last").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing worth keeping: leave no half run
        raise
    finally:
        if bar is not None:
            bar.stop()

    elapsed = elapsed_before + (time.time() - t_start)
    if dist_info.is_main:
        note = plot_loss_curve(metrics.read(), run_dir / "loss.png")
        if note:
            info(f"note: {note}")
        if stopped in ("SIGINT", "SIGTERM"):
            info(f"stopped by {stopped} at step {step}; resume with: lmcli train --resume {run_dir}")
        elif stopped == "max_time":
            info(
                f"time limit reached at step {step}; "
                f"continue with: lmcli train --resume {run_dir} --max-time ..."
            )
        info(f"done in {fmt_duration(elapsed)}: best validation loss {best_val:.4f}; run folder {run_dir}")
    return TrainResult(
        run_dir, step, train_loss, val_loss, best_val if math.isfinite(best_val) else None, elapsed, stopped
    )


def _probe_step_seconds(
    model: torch.nn.Module, sampler: Any, cfg: TrainConfig, device: torch.device, amp: torch.dtype | None
) -> float:
    """Time one forward/backward micro-step without touching the RNG, weights or data position."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        b = sampler.batch(0, cfg.batch_size).to(device)
        times = []
        for _ in range(2):  # the first call warms up allocators and kernels
            t0 = time.perf_counter()
            with autocast(device, amp):
                logits, targets = forward_scored(model, b, cfg)
                loss = F.cross_entropy(logits.float(), targets)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times[-1] * 1.15  # the optimizer step and data loading add a little


def _write_run_config(run_dir: Path, model_config: ModelConfig, cfg: TrainConfig) -> None:
    import json

    tmp = run_dir / ".config.json.tmp"
    tmp.write_text(json.dumps({"model": to_dict(model_config), "train": to_dict(cfg)}, indent=2) + "\n")
    os.replace(tmp, run_dir / "config.json")
