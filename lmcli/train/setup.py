"""A run opened: options resolved, run folder, data, model placed on its device(s), state
restored on resume, and the pre-flight screen.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lmcli.config.files import resolve_vocab_multiple, to_dict
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.data.examples import pad_multiple
from lmcli.data.preferences import load_preference_data, load_prompt_data
from lmcli.data.train_data import ExampleData, TrainData, load_train_data
from lmcli.device import (
    Staging,
    autocast_dtype,
    configure_backend,
    usable_cpus,
)
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    META,
    copy_checkpoint,
    is_sharded,
    last_checkpoint,
    read_json,
)
from lmcli.formats.lora_base import base_reference
from lmcli.formats.sources import load_checkpoint
from lmcli.formats.weights import model_from_state, model_state
from lmcli.model import lora
from lmcli.model.transformer import Transformer
from lmcli.safe_io import refuse_symlinks
from lmcli.tasks import make_task
from lmcli.train.averaging import EMA
from lmcli.train.distributed import (
    Dist,
    in_turn,
    on_main,
)
from lmcli.train.init_from import init_source, open_init
from lmcli.train.losses import probe_step_seconds
from lmcli.train.metrics import MetricsLog
from lmcli.train.mfu import MfuBasis, flops_per_token, matmul_params
from lmcli.train.optim import make_optimizer
from lmcli.train.parallel import (
    Fill,
    Single,
    choose_parallel,
    make_parallel,
    per_process_memory,
)
from lmcli.train.post import open_method
from lmcli.train.post.distill import student_start
from lmcli.train.preflight import (
    Preflight,
    available_memory,
    fmt_count,
    measured_memory,
    preflight_rows,
    replica_memory,
    skeleton,
)
from lmcli.train.run import Marks, Method, Reporter, Run
from lmcli.train.run_folder import (
    RunFolder,
    absolute_paths,
    check_resumable,
    create_run_dir,
    open_run_dir,
    write_run_config,
)
from lmcli.train.sharded import open_sharded
from lmcli.train.state import COUNTERS, RngStates, Stateful, StateRegistry, TrainState, seed_everything
from lmcli.train.task_scores import load_eval_tasks
from lmcli.train.tracking import open_trackers, require_backends


def open_run(
    model_config: ModelConfig,
    cfg: TrainConfig,
    resume: str | Path | None,
    rep: Reporter,
    progress: bool,
    dist_info: Dist,
    device: torch.device,
    held: list[RunFolder],
    closing: contextlib.ExitStack,
) -> Run:
    """The run folder (locked, into ``held``), data, model, optimizer, state and method of a new
    or resumed run; what the method starts beside this process is stopped by ``closing``."""
    configure_backend(device)
    amp = autocast_dtype(device, cfg.dtype)
    info = rep.info if dist_info.is_main else (lambda msg: None)
    require_backends(cfg.trackers)  # before a run folder exists: one line naming what to install
    run_dir, resumed = locate_run(model_config, cfg, resume, dist_info, held)
    cfg = replace(absolute_paths(cfg), out=str(run_dir))
    eval_tasks = load_eval_tasks(cfg) if dist_info.is_main else []  # a bad file stops the run here
    source, init, tokenizer = starting_point(cfg, resumed, info, model_config.block_size)
    model_config = init.config if init else model_config
    base = resumed.base if resumed else base_reference(source) if cfg.lora.lora_rank and source else None
    data = open_data(cfg, model_config, tokenizer, progress, dist_info, device, info)
    model_config = run_model_config(model_config, cfg, data, resumed, init, device)
    parallel, model, trained, averages = place_model(model_config, cfg, resumed, init, dist_info, device, amp)
    seed_everything(cfg.seed + dist_info.rank)  # dropout differs per rank, the data never overlaps
    method = open_method(cfg, model, resumed, data)  # dpo, grpo: the reference, rewards; distill: the teacher
    closing.callback(method.close)
    sampler = method.sampler(data, cfg.optim.batch_size, cfg.seed)
    optimizer, scaler, state, states = training_state(model, cfg, amp, dist_info, device, averages, method)
    if resumed is not None:
        parallel.restore(resumed, model, states)
        into = "" if Path(resume) == run_dir else f" into {run_dir}"
        info(f"resuming {resume} at step {state.step}{into}")
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
        mfu=MfuBasis.on(device, training_flops(model, cfg, data), cfg.peak_tflops),
        info=info,
        staging=Staging(device),
        base=base,
        eval_tasks=eval_tasks,
        method=method,
    )
    method.begin(run, fresh=resumed is None)  # dpo --precompute-reference: the model as it starts
    if dist_info.is_main:
        facts = show_preflight(run, rep)
        write_run_config(run_dir, model_config, cfg)
        if resumed:
            carry_history(run)
        trackers.start({"model": to_dict(model_config), "train": to_dict(cfg)}, facts)
    return run


def starting_point(
    cfg: TrainConfig, resumed: Any, info: Callable[[str], None], block_size: int
) -> tuple[Any, Any, Any]:
    """What a new run starts from: ``--init-from``'s source (asked once) and model, and the
    tokenizer: the resumed run's, the imported model's, or (distill) the teacher's, whose blocks
    the student may start from (``student_start``); None: one trained on the corpus."""
    source = init_source(cfg.init_from) if cfg.init_from and not resumed else None
    init = open_init(source, info, block_size) if source else None
    init, tokenizer = student_start(cfg, resumed, init, info, block_size)
    return source, init, tokenizer


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
    kind = make_task(cfg).examples
    if kind in ("preferences", "prompts"):  # post-training's rows, in the model's tokenizer
        block = model_config.block_size
        if kind == "preferences":
            data: Any = load_preference_data(cfg, block, tokenizer)
            data.pad_multiple = pad_multiple(cfg.compile, device)
            return data
        return load_prompt_data(cfg, block, tokenizer, check=None)
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
    method: Method[Any] | None = None,
) -> tuple[Any, torch.amp.GradScaler, TrainState, StateRegistry]:
    """The optimizer (of the model as it trains: sharded parameters under FSDP), grad scaler
    and counters of a new run, each registered once, with every rank's RNGs, the weight
    ``averages`` and the ``method``'s own parts, in the ``StateRegistry`` that saves and
    restores them."""
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
    states.parts.update(method.parts() if method is not None else {})  # dpo's precomputed reference
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


def preflight_memory(run: Run, probed: bool, trainable: int) -> int:
    """Bytes a process needs: on a GPU after a probe step, its measured peak plus the optimizer
    state of what trains; otherwise the method's estimate (per process: sharded state split)."""
    if probed and run.device.type == "cuda":  # the probe's peak holds a reference copy already
        return measured_memory(torch.cuda.max_memory_allocated(run.device), trainable)
    return run.method.memory(run, run.dist.world_size if run.parallel.sharded else 1)


def show_preflight(run: Run, rep: Reporter) -> dict[str, str]:
    """One screen of facts before training: size, data, memory and time estimates (returned, for
    the trackers)."""
    cfg, model = run.cfg, run.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    alone = not (cfg.compile or run.parallel.sharded)  # a sharded model steps with every rank
    alone = alone and run.method.probes  # (a grpo step samples first: no probe)
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
        step_seconds=probe * cfg.optim.grad_accum + run.method.extra_seconds(run)
        if probe is not None
        else None,
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
    facts.update(run.method.describe())  # dpo, grpo: a post-training row; distill: the teacher's
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
