"""Training's GPU-path logic, checked on the CPU with torch.cuda and torch.distributed mocked
where needed (issue 19): per-device RNG state, scaler state on resume, collective timeouts, DDP
options, pre-flight memory and MFU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import TINY_TEXT, assert_one_line_error, run_cli, train_config

from lmcli.config.model import ModelConfig
from lmcli.model.transformer import Transformer
from lmcli.train import Reporter, train
from lmcli.train.display import TrainProgress
from lmcli.train.distributed import SETUP_TIMEOUT, STEP_TIMEOUT, Dist, init_distributed
from lmcli.train.metrics import MetricsLog
from lmcli.train.mfu import flops_per_token, gpu_peak_tflops, matmul_params, measured_cpu_tflops, mfu
from lmcli.train.optim import make_optimizer
from lmcli.train.parallel import make_parallel
from lmcli.train.preflight import estimate_memory, measured_memory
from lmcli.train.sharded import restore
from lmcli.train.state import COUNTERS, RngStates, StateRegistry, TrainState, rng_state, set_rng_state

MODEL = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)


class FakeCudaRng:
    """torch.cuda's RNG calls on a machine with ``n`` GPUs, recording what was set where."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.n, self.set_on = n, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.get(i) for i in range(n)])

    def get(self, device=0) -> torch.Tensor:
        index = torch.device(device).index if not isinstance(device, int) else device
        assert index < self.n, f"GPU {index} does not exist"
        return torch.full((4,), index, dtype=torch.uint8)

    def set(self, state: torch.Tensor, device=0) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        assert index < self.n, f"GPU {index} does not exist"
        self.set_on.append((index, int(state[0])))


def test_rng_state_holds_only_the_process_own_gpu(monkeypatch) -> None:
    saved_on_8 = FakeCudaRng(monkeypatch, 8)
    state = rng_state(torch.device("cuda", 5))
    assert torch.equal(state["cuda"], torch.full((4,), 5, dtype=torch.uint8))  # one device's state
    # resumed where only 2 GPUs are visible, as rank 1 on cuda:1: its own state goes to its own GPU
    fewer = FakeCudaRng(monkeypatch, 2)
    set_rng_state(state, torch.device("cuda", 1))
    assert fewer.set_on == [(1, 5)] and not saved_on_8.set_on


def test_an_old_every_gpu_rng_list_never_indexes_a_missing_gpu(monkeypatch) -> None:
    old = {**rng_state(), "cuda": [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]}
    gpus = FakeCudaRng(monkeypatch, 2)
    set_rng_state(old, torch.device("cuda", 1))  # the state of the same index, on that GPU only
    assert gpus.set_on == [(1, 1)]
    short = {**old, "cuda": old["cuda"][:1]}
    set_rng_state(short, torch.device("cuda", 1))  # no saved state for this index: left as seeded
    assert gpus.set_on == [(1, 1)]


def test_a_cpu_run_saves_no_gpu_state() -> None:
    assert "cuda" not in rng_state(torch.device("cpu"))


def test_resuming_a_bf16_run_in_float16_starts_a_fresh_scaler() -> None:
    """A bf16 (or float32) run saves the state of a disabled GradScaler, an empty dict; loading it
    into the enabled scaler of a float16 resume used to raise."""
    model = Transformer(replace(MODEL, vocab_size=20))
    cfg = train_config(corpus=("x",))
    saved = {
        **TrainState(step=7).state_dict(),
        "optimizer": make_optimizer(model, cfg, torch.device("cpu")).state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        "rng": [rng_state()],
    }
    assert saved["scaler"] == {}
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    state = TrainState()

    def registry() -> StateRegistry:
        optimizer = make_optimizer(model, cfg, torch.device("cpu"))
        parts = {COUNTERS: state, "optimizer": optimizer, "scaler": scaler, "rng": RngStates(Dist())}
        return StateRegistry(parts)

    restore(registry(), saved, cfg)
    assert state.step == 7 and scaler.get_scale() == 1024.0
    # a float16 run's scale is carried over
    saved["scaler"] = torch.amp.GradScaler("cpu", init_scale=64.0).state_dict()
    restore(registry(), saved, cfg)
    assert scaler.get_scale() == 64.0


def test_process_groups_get_explicit_timeouts(monkeypatch) -> None:
    """The training group fails fast; the control group, which waits while rank 0 tokenizes, has
    the long setup timeout (not torch's default 30 minutes)."""
    import torch.distributed as dist

    calls: list[tuple[str, dict]] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("group", kw)) or "control")
    info, device = init_distributed("cpu")
    assert (info.rank, info.world_size, info.control, device.type) == (1, 2, "control", "cpu")
    assert calls == [
        ("init", {"backend": "gloo", "timeout": STEP_TIMEOUT}),
        ("group", {"backend": "gloo", "timeout": SETUP_TIMEOUT}),
    ]
    assert SETUP_TIMEOUT.total_seconds() >= 6 * 3600 > STEP_TIMEOUT.total_seconds()


def test_ddp_neither_broadcasts_buffers_nor_copies_gradients(monkeypatch) -> None:
    import torch.nn.parallel

    seen: dict = {}

    class FakeDDP(torch.nn.Module):
        def __init__(self, module, **kwargs) -> None:
            super().__init__()
            self.module = module
            seen.update(kwargs)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    model = Transformer(ModelConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=16))
    parallel = make_parallel("ddp", train_config(corpus=("x",)), Dist(0, 0, 2), torch.device("cpu"), None)
    trained = parallel.wrap(model, [])
    assert parallel.ddp is trained
    assert seen["broadcast_buffers"] is False and seen["gradient_as_bucket_view"] is True


def test_preflight_memory_without_scores_under_flash_and_from_a_measured_peak() -> None:
    cfg = ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    params = 124_000_000
    plain = estimate_memory(cfg, params, 12, autocast=True)
    flash = estimate_memory(cfg, params, 12, autocast=True, flash=True)
    assert plain - flash == 12 * 5 * 12 * 12 * 1024 * 1024 * 2 // 2  # the T×T scores, gone
    assert measured_memory(3_000_000_000, params) == 3_000_000_000 + 8 * params  # + AdamW moments


def test_flops_per_token_is_nanogpts_estimate_for_gpt2_small() -> None:
    cfg = ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    with torch.device("meta"):
        model = Transformer(cfg)
    n = matmul_params(model)
    # nanoGPT's N: every parameter but the position table (the tied embedding counts once)
    assert n == model.num_parameters() - 1024 * 768
    assert flops_per_token(cfg, n) == 6 * n + 12 * 12 * 12 * 64 * 1024
    assert 0.85e9 < flops_per_token(cfg, n) < 0.88e9
    assert mfu(100_000, 1e9, 312.0) == pytest.approx(100_000 * 1e9 / 312e12)
    assert mfu(100_000, 1e9, 312.0, devices=2) == pytest.approx(mfu(100_000, 1e9, 312.0) / 2)
    assert mfu(100_000, 1e9, None) is None


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla T4", 65.0),
        ("Some Future GPU", None),
    ],
)
def test_gpu_peak_table(name: str, peak: float | None) -> None:
    assert gpu_peak_tflops(name) == peak


def test_cpu_peak_is_measured_without_touching_the_global_rng() -> None:
    before = torch.get_rng_state()
    assert 1e-4 < measured_cpu_tflops(0.05, 128) < 100
    assert torch.equal(torch.get_rng_state(), before)  # a resumed run's restored RNG stays as it was


def test_mfu_is_in_metrics_and_the_progress_line(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT)
    cfg = train_config(
        corpus=(str(corpus),),
        out=str(tmp_path / "run"),
        batch_size=4,
        max_steps=4,
        log_interval=2,
        eval_interval=4,
        eval_batches=1,
        peak_tflops=0.5,
    )
    result = train(MODEL, cfg, reporter=Reporter(info=lambda msg: None), progress=False)
    records = [r for r in MetricsLog(result.run_dir / "metrics.jsonl").read() if "train_loss" in r]
    model_cfg = json.loads((result.run_dir / "config.json").read_text())["model"]
    with torch.device("meta"):
        model = Transformer(ModelConfig(**model_cfg))
    per_token = flops_per_token(model.config, matmul_params(model))
    for r in records:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 0.5e12)

    class Console:
        def __init__(self) -> None:
            self.lines: list[str] = []

    bar = TrainProgress(Console())
    shown: list[str] = []
    bar.progress = type(
        "P",
        (),
        {"tasks": [type("T", (), {"total": 4})()], "update": lambda s, t, **k: shown.append(k["stats"])},
    )()
    bar.update(2, {**records[0], "mfu": 0.412})
    assert "MFU 41.2%" in shown[0]


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_a_peak_that_is_not_a_positive_number_is_refused(tmp_path: Path, capsys, value: str) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT)
    code, _, err = run_cli(
        ["train", str(corpus), "--out", str(tmp_path / "run"), "--peak-tflops", value], capsys
    )
    assert_one_line_error(code, err, "peak-tflops must be")
    assert not (tmp_path / "run").exists()


def test_sigterm_saves_first_and_never_validates(tmp_path: Path, monkeypatch) -> None:
    """torchrun kills workers 30 s after SIGTERM: the stop path writes the checkpoint without a
    validation (or a BLEU decode) before it."""
    import os
    import signal

    import lmcli.train.loop as loop

    validated: list[int] = []
    real_validate = loop.validate
    monkeypatch.setattr(loop, "validate", lambda run: validated.append(run.state.step) or real_validate(run))

    class TermAt:
        def start(self, total, step, max_time=None, shown=()) -> None:
            pass

        def update(self, step: int, record: dict) -> None:
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        def stop(self) -> None:
            pass

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TINY_TEXT)
    cfg = train_config(
        corpus=(str(corpus),),
        out=str(tmp_path / "run"),
        batch_size=4,
        max_steps=50,
        log_interval=1,
        eval_interval=100,
        peak_tflops=1.0,
    )
    result = train(MODEL, cfg, reporter=Reporter(info=lambda m: None, progress=TermAt()), progress=False)
    assert result.stopped == "SIGTERM" and result.step == 3 and validated == []
    meta = json.loads((result.run_dir / "last" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["val_loss"] is None
