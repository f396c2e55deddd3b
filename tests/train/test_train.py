"""Training: losses fall, runs are deterministic, resume equals an uninterrupted run."""

from __future__ import annotations

import json
import math
import signal
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from helpers import TINY_TEXT, CrashAt, assert_same_weights, tiny_model, tiny_tokenizer, train_config, weights

from lmcli.config.files import replace_options
from lmcli.config.model import ModelConfig
from lmcli.config.train import TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import save_checkpoint
from lmcli.formats.sources import load_checkpoint
from lmcli.text.tokenizer import Tokenizer
from lmcli.train import Reporter, train
from lmcli.train.metrics import MetricsLog
from lmcli.train.optim import lr_at

MODEL = ModelConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


def config(tmp_path: Path, name: str, **kw) -> TrainConfig:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TINY_TEXT)
    base = dict(
        corpus=(str(corpus),),
        out=str(tmp_path / name),
        batch_size=8,
        max_steps=40,
        eval_interval=10,
        log_interval=5,
        warmup_steps=5,
        eval_batches=2,
        lr=3e-3,
    )
    base.update(kw)
    return train_config(**base)


def quiet() -> Reporter:
    return Reporter(info=lambda msg: None)


def test_loss_falls_and_the_run_folder_is_complete(tmp_path: Path) -> None:
    result = train(MODEL, config(tmp_path, "run"), reporter=quiet(), progress=False)
    run = result.run_dir
    records = MetricsLog(run / "metrics.jsonl").read()
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.8  # char model on repetitive text learns fast
    unigram = math.log(Tokenizer.load(run / "last" / "tokenizer.json").vocab_size)
    assert result.best_val_loss < unigram - 1.0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "meta.json"):
        assert (run / "last" / name).exists() and (run / "best" / name).exists()
    assert (run / "config.json").exists() and (run / "loss.png").exists()
    assert all("grad_norm" in r for r in records if "train_loss" in r)
    ckpt = load_checkpoint(run)  # the run folder alone is enough
    assert ckpt.path.name == "best" and ckpt.model_config.n_embd == 32


def test_seeded_runs_are_identical_and_seeds_matter(tmp_path: Path) -> None:
    a = train(MODEL, config(tmp_path, "a", max_steps=10), reporter=quiet(), progress=False)
    b = train(MODEL, config(tmp_path, "b", max_steps=10), reporter=quiet(), progress=False)
    c = train(MODEL, config(tmp_path, "c", max_steps=10, seed=7), reporter=quiet(), progress=False)
    assert_same_weights(weights(a.run_dir), weights(b.run_dir))
    assert not torch.equal(weights(a.run_dir)["wte.weight"], weights(c.run_dir)["wte.weight"])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path: Path, dropout: float) -> None:
    model = replace(MODEL, dropout=dropout)
    full = train(model, config(tmp_path, "full", max_steps=30), reporter=quiet(), progress=False)
    cfg = config(tmp_path, "crashed", max_steps=30)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model, cfg, reporter=Reporter(info=lambda m: None, progress=CrashAt(15)), progress=False)
    assert load_checkpoint(tmp_path / "crashed" / "last").meta["step"] == 10
    resumed = train(model, cfg, resume=tmp_path / "crashed", reporter=quiet(), progress=False)
    assert resumed.step == 30
    assert_same_weights(weights(full.run_dir), weights(resumed.run_dir))
    steps = [
        r["step"] for r in MetricsLog(tmp_path / "crashed" / "metrics.jsonl").read() if "train_loss" in r
    ]
    assert steps == sorted(set(steps)), "metrics logged after the checkpoint are not duplicated"


def test_sigint_saves_a_checkpoint_that_resumes_exactly(tmp_path: Path) -> None:
    full = train(MODEL, config(tmp_path, "full", max_steps=30), reporter=quiet(), progress=False)
    cfg = config(tmp_path, "stopped", max_steps=30)
    first = train(
        MODEL,
        cfg,
        reporter=Reporter(info=lambda m: None, progress=CrashAt(15, signal.SIGINT)),
        progress=False,
    )
    assert first.stopped == "SIGINT" and first.step == 15
    assert load_checkpoint(tmp_path / "stopped" / "last").meta["step"] == 15
    resumed = train(MODEL, cfg, resume=tmp_path / "stopped", reporter=quiet(), progress=False)
    assert_same_weights(weights(full.run_dir), weights(resumed.run_dir))


def test_resume_may_extend_the_run_but_not_change_the_shape(tmp_path: Path) -> None:
    cfg = config(tmp_path, "run", max_steps=10)
    train(MODEL, cfg, reporter=quiet(), progress=False)
    longer = train(
        MODEL, replace_options(cfg, max_steps=20), resume=tmp_path / "run", reporter=quiet(), progress=False
    )
    assert longer.step == 20
    with pytest.raises(LmcliError, match="different model shape .*n-layer 2 -> 3"):
        train(replace(MODEL, n_layer=3), cfg, resume=tmp_path / "run", reporter=quiet(), progress=False)


def test_max_time_stops_with_a_checkpoint(tmp_path: Path) -> None:
    result = train(
        MODEL, config(tmp_path, "t", max_steps=None, max_time=1.0), reporter=quiet(), progress=False
    )
    assert result.stopped == "max_time" and result.step > 0
    assert load_checkpoint(tmp_path / "t" / "last").meta["step"] == result.step


def test_epochs_set_the_number_of_steps(tmp_path: Path) -> None:
    cfg = config(tmp_path, "e", max_steps=None, epochs=1.0, batch_size=4)
    result = train(MODEL, cfg, reporter=quiet(), progress=False)
    n_windows = (int(len(TINY_TEXT) * 0.9) + 1 - 1) // 16  # train tokens include the trailing <eos>
    assert abs(result.step - math.ceil(n_windows / 4)) <= 1


def test_keep_last_keeps_periodic_checkpoints(tmp_path: Path) -> None:
    train(MODEL, config(tmp_path, "k", max_steps=40, keep_last=2), reporter=quiet(), progress=False)
    assert sorted(p.name for p in (tmp_path / "k").glob("step-*")) == ["step-0000030", "step-0000040"]


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = train_config(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, 100) for s in range(100)]
    assert lrs[0] < lrs[5] < lrs[9] < 1.0
    assert lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)


def test_checkpoint_of_a_compiled_model_loads_into_a_plain_one(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    model = tiny_model(seed=None, **asdict(replace(MODEL, vocab_size=tok.vocab_size)))
    compiled = torch.compile(model)  # only wrapped: its state_dict has _orig_mod. names
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    save_checkpoint(tmp_path / "c", compiled, train_config(), tok, meta={"step": 0})
    loaded = load_checkpoint(tmp_path / "c").model
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)


def test_deterministic_flag_turns_on_torchs_deterministic_algorithms_for_the_run(
    tmp_path: Path, monkeypatch
) -> None:
    import lmcli.train.losses as losses  # where a training step's loss is computed (NextToken)

    seen = []
    original = losses.batch_loss

    def spy(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(losses, "batch_loss", spy)
    train(MODEL, config(tmp_path, "plain", max_steps=2), reporter=quiet(), progress=False)
    result = train(
        MODEL, config(tmp_path, "det", max_steps=2, deterministic=True), reporter=quiet(), progress=False
    )
    assert seen == [False, False, True, True]
    assert not torch.are_deterministic_algorithms_enabled()  # only for the run
    assert json.loads((result.run_dir / "config.json").read_text())["train"]["deterministic"] is True


# ----------------------------------------------------------------------------- issue 18: Muon, EMA, schedules


@pytest.mark.parametrize(
    "options", [dict(optimizer="muon"), dict(ema=0.9), dict(optimizer="muon", ema=0.95, schedule="wsd")]
)
def test_muon_and_ema_resume_bit_identically(tmp_path: Path, options: dict) -> None:
    """Crash after the step-10 checkpoint, resume: weights (and the EMA checkpoint) equal an
    uninterrupted run's bit for bit, so the Muon momentum and the average are restored exactly."""
    full = train(MODEL, config(tmp_path, "full", max_steps=20, **options), reporter=quiet(), progress=False)
    cfg = config(tmp_path, "crashed", max_steps=20, **options)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(MODEL, cfg, reporter=Reporter(info=lambda m: None, progress=CrashAt(15)), progress=False)
    resumed = train(MODEL, cfg, resume=tmp_path / "crashed", reporter=quiet(), progress=False)
    assert_same_weights(weights(full.run_dir), weights(resumed.run_dir))
    if options.get("ema"):
        ema_full, ema_resumed = (load_checkpoint(r / "ema") for r in (full.run_dir, resumed.run_dir))
        resumed_state = ema_resumed.model.state_dict()
        for name, value in ema_full.model.state_dict().items():
            assert torch.equal(value, resumed_state[name]), name
        last = load_checkpoint(full.run_dir / "last").model.state_dict()["wte.weight"]
        assert not torch.equal(ema_full.model.state_dict()["wte.weight"], last), "an average, not a copy"
        records = MetricsLog(full.run_dir / "metrics.jsonl").read()
        assert [r["step"] for r in records if "val_loss_ema" in r] == [10, 20]


def test_muon_trains_the_block_matrices_and_adamw_the_rest(tmp_path: Path) -> None:
    from lmcli.train.optim import MuonAdamW, make_optimizer

    model = tiny_model(13, n_embd=16)
    opt = make_optimizer(model, train_config(optimizer="muon", muon_lr=0.05, lr=1e-3), torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in muon) == (name.startswith("h.") and p.dim() == 2), name
    assert opt.muon.param_groups[0]["lr"] == 0.05 and all(g["lr"] == 1e-3 for g in opt.adamw.param_groups)
    result = train(
        MODEL, config(tmp_path, "m", max_steps=30, optimizer="muon"), reporter=quiet(), progress=False
    )
    records = MetricsLog(result.run_dir / "metrics.jsonl").read()
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.8


def test_resuming_with_another_optimizer_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    from helpers import assert_one_line_error, run_cli

    train(MODEL, config(tmp_path, "run", max_steps=10, optimizer="adamw"), reporter=quiet(), progress=False)
    before = (tmp_path / "run" / "last" / "model.safetensors").read_bytes()
    code, _, err = run_cli(["train", "--resume", str(tmp_path / "run"), "--optimizer", "muon", "-q"], capsys)
    assert_one_line_error(
        code, err, "cannot resume a run trained with --optimizer adamw with --optimizer muon"
    )
    assert (tmp_path / "run" / "last" / "model.safetensors").read_bytes() == before


def test_schedules_warm_up_and_end_at_the_floor_by_steps_or_by_time() -> None:
    wsd = train_config(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="wsd", decay_fraction=0.2)
    lrs = [lr_at(s, wsd, 100) for s in range(101)]
    assert (
        lrs[9] < 1.0 and all(lr == 1.0 for lr in lrs[10:80]) and lrs[80] == pytest.approx(1.0)
    )  # stable to 80%
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:], strict=False)) and lrs[100] == pytest.approx(0.1)
    assert lrs[90] == pytest.approx(0.55)  # linear in the last 20%
    # bounded by --max-time only: the time fraction drives the same shape
    assert lr_at(500, wsd, None, time_fraction=0.5) == 1.0
    assert lr_at(500, wsd, None, time_fraction=0.9) == pytest.approx(0.55)
    assert lr_at(500, wsd, None, time_fraction=1.0) == pytest.approx(0.1)
    linear = train_config(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert [lr_at(s, linear, 4) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert lr_at(0, linear, None, time_fraction=0.25) == pytest.approx(0.75)


def test_muon_groups_follow_the_schedule_from_their_own_peak(tmp_path: Path) -> None:
    result = train(
        MODEL,
        config(
            tmp_path, "m", max_steps=10, optimizer="muon", muon_lr=0.03, schedule="linear", warmup_steps=0
        ),
        reporter=quiet(),
        progress=False,
    )
    state = torch.load(result.run_dir / "last" / "trainer_state.pt", weights_only=True)["optimizer"]
    muon_lr = state["muon"]["param_groups"][0]["lr"]
    adamw_lr = state["adamw"]["param_groups"][0]["lr"]
    assert muon_lr / 0.03 == pytest.approx(adamw_lr / 3e-3) and adamw_lr < 3e-3


def test_average_of_the_last_checkpoints_is_their_mean_and_a_loadable_checkpoint(
    tmp_path: Path, capsys
) -> None:
    from helpers import assert_one_line_error, run_cli

    from lmcli.train.averaging import average_checkpoints

    run = train(
        MODEL,
        config(tmp_path, "run", max_steps=40, keep_last=3, save_interval=10),
        reporter=quiet(),
        progress=False,
    ).run_dir
    kept = sorted(p.name for p in run.glob("step-*"))
    assert kept == ["step-0000020", "step-0000030", "step-0000040"]
    code, out, _ = run_cli(["average", str(run), "--last", "2"], capsys)
    assert code == 0 and str(run / "average-last-2") in out
    mean = load_checkpoint(run / "average-last-2")
    a, b = (load_checkpoint(run / name).model.state_dict() for name in kept[1:])
    for name, value in mean.model.state_dict().items():
        torch.testing.assert_close(value, (a[name] + b[name]) / 2, rtol=0, atol=1e-7)
    assert mean.meta["step"] == 40 and mean.meta["averaged"] == kept[1:]
    assert not torch.equal(mean.model.state_dict()["wte.weight"], b["wte.weight"])
    code, _, err = run_cli(["average", str(run), "--last", "4"], capsys)
    assert_one_line_error(code, err, "has 3 step-N checkpoint(s), --last 4 asks for more")
    code, _, err = run_cli(["average", str(run), "--last", "2"], capsys)
    assert_one_line_error(code, err, "average-last-2 already exists")
    with pytest.raises(LmcliError, match="no such run folder"):
        average_checkpoints(tmp_path / "nothing", 2)


def test_cpu_muon_is_torchs_muon_in_float32() -> None:
    """lmcli's CPU Muon takes torch's step (torch's Newton-Schulz runs in bfloat16: equal to its
    rounding, ~3% of the update) and keeps the same state."""
    from lmcli.train.optim import Muon

    torch.manual_seed(0)
    shapes = [(96, 32), (32, 96), (32, 32)]
    ours = [torch.nn.Parameter(0.02 * torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = Muon(ours, lr=0.02, weight_decay=0.1), torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    start = [p.detach().clone() for p in ours]
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q, p0 in zip(ours, theirs, start, strict=True):
        moved = (q - p0).abs().max().item()
        assert (p - q).abs().max().item() < 0.05 * moved
    assert a.state_dict()["state"].keys() == b.state_dict()["state"].keys()
    for s_a, s_b in zip(a.state_dict()["state"].values(), b.state_dict()["state"].values(), strict=True):
        torch.testing.assert_close(s_a["momentum_buffer"], s_b["momentum_buffer"])


def test_auto_is_muon_and_wsd_from_scratch_adamw_and_cosine_elsewhere_and_old_runs_keep_theirs() -> None:
    from lmcli.config.files import stored_fields

    scratch = train_config()
    assert (scratch.optimizer_kind, scratch.schedule_kind) == ("muon", "wsd")
    fine_tune = train_config(init_from="some/folder")
    assert (fine_tune.optimizer_kind, fine_tune.schedule_kind) == ("adamw", "cosine")
    translation = train_config(task="translation", source="a.txt", target="b.txt")
    assert (translation.optimizer_kind, translation.schedule_kind) == ("adamw", "cosine")
    pinned = train_config(optimizer="adamw", schedule="linear")
    assert (pinned.optimizer_kind, pinned.schedule_kind) == ("adamw", "linear")
    # a run folder written before the options existed trained with AdamW and cosine: it resumes so
    old = train_config(**stored_fields(TrainConfig, {"lr": 1e-3}))
    assert (old.optimizer_kind, old.schedule_kind) == ("adamw", "cosine")


# ----------------------------------------------------------------------------- issue 19: vocabulary padding


def test_a_run_with_vocab_multiple_64_learns_and_resumes_exactly_on_the_cpu(tmp_path: Path, capsys) -> None:
    """``--vocab-multiple 64`` pads the 25-token char vocabulary to 64 rows on a CPU: the loss
    falls, the checkpoint holds 64 rows and records 64, and a run killed after its step-10
    checkpoint, resumed with the default (auto), equals the uninterrupted run bit for bit (the
    optimizer state has the padded shapes)."""
    from helpers import FAST_TRAIN_ARGS, run_cli

    (tmp_path / "corpus.txt").write_text(TINY_TEXT)
    code, _, err = run_cli(
        ["train", str(tmp_path / "corpus.txt"), "--vocab-multiple", "64", "-o", str(tmp_path / "cli")]
        + [*FAST_TRAIN_ARGS, "--max-steps", "2"],
        capsys,
    )
    assert code == 0, err
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["model"]["vocab_multiple"] == 64
    assert weights(tmp_path / "cli")["wte.weight"].shape == (64, 16)

    padded = replace(MODEL, vocab_multiple=64)
    full = train(padded, config(tmp_path, "full", max_steps=20), reporter=quiet(), progress=False)
    losses = [r["train_loss"] for r in MetricsLog(full.run_dir / "metrics.jsonl").read() if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.5
    cfg = config(tmp_path, "crashed", max_steps=20)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(padded, cfg, reporter=Reporter(info=lambda m: None, progress=CrashAt(15)), progress=False)
    resumed = train(MODEL, cfg, resume=tmp_path / "crashed", reporter=quiet(), progress=False)
    assert_same_weights(weights(full.run_dir), weights(resumed.run_dir))
    assert weights(resumed.run_dir)["wte.weight"].shape == (64, 32)
    with pytest.raises(LmcliError, match="different model shape .*vocab-multiple 64 -> 8"):
        train(
            replace(MODEL, vocab_multiple=8),
            cfg,
            resume=tmp_path / "crashed",
            reporter=quiet(),
            progress=False,
        )


def test_auto_vocab_multiple_is_64_on_cuda_and_1_elsewhere_and_the_checkpoint_records_it(
    tmp_path: Path, monkeypatch
) -> None:
    """auto is resolved where training knows its device and the number is stored: a run trained
    (as if) on CUDA holds 64 rows and loads with them on a CPU; a CPU run holds 1."""
    from lmcli.config.files import resolve_vocab_multiple
    from lmcli.train import setup

    assert resolve_vocab_multiple(ModelConfig(), "cuda").vocab_multiple == 64
    assert resolve_vocab_multiple(ModelConfig(), "cpu").vocab_multiple == 1
    assert resolve_vocab_multiple(ModelConfig(), "mps").vocab_multiple == 1
    assert resolve_vocab_multiple(ModelConfig(vocab_multiple=8), "cuda").vocab_multiple == 8
    cpu = train(MODEL, config(tmp_path, "cpu", max_steps=1), reporter=quiet(), progress=False)
    assert load_checkpoint(cpu.run_dir).model_config.vocab_multiple == 1
    assert (
        weights(cpu.run_dir)["wte.weight"].shape[0]
        == Tokenizer.load(cpu.run_dir / "last" / "tokenizer.json").vocab_size
    )
    # the loop's device mocked as a GPU (the tensors stay on the CPU): the auto choice is 64
    as_cuda = lambda cfg, kind: resolve_vocab_multiple(cfg, "cuda")  # noqa: E731
    monkeypatch.setattr(setup, "resolve_vocab_multiple", as_cuda)
    gpu = train(MODEL, config(tmp_path, "gpu", max_steps=1), reporter=quiet(), progress=False)
    monkeypatch.undo()
    stored = json.loads((gpu.run_dir / "last" / "config.json").read_text())["model"]
    assert stored["vocab_multiple"] == 64
    ckpt = load_checkpoint(gpu.run_dir)  # on this CPU, with its padding
    assert ckpt.model.wte.weight.shape == (64, 32) and ckpt.model_config.vocab_multiple == 64


# ----------------------------------------------------------------------------- issue 37: Gemma 3, Qwen3

GEMMA3_TOML = """
[model]
n-layer = 2
n-head = 2
n-kv-head = 1
n-embd = 32
head-size = 24
block-size = 16
position = "rope"
norm = "rmsnorm1p"
norm-placement = "sandwich"
mlp = "geglu"
bias = false
qk-norm = true
scale-embeddings = true
sliding-window = 4
layer-pattern = "LG"
rope-local-base = 100.0
attn-scalar = 16.0
attn-softcap = 50.0
"""
QWEN3 = replace(
    MODEL,
    position="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    qk_norm=True,
    head_size=24,
    n_kv_head=1,
    sliding_window=4,
    layer_pattern="GL",
    tie_embeddings=False,
)


def test_a_gemma3_shaped_model_from_a_toml_trains_from_scratch(tmp_path: Path, capsys) -> None:
    """Every Gemma 3 option from a TOML file through `lmcli train`: the run holds them, learns."""
    from helpers import run_cli

    (tmp_path / "corpus.txt").write_text(TINY_TEXT)
    (tmp_path / "gemma3.toml").write_text(GEMMA3_TOML)
    argv = ["train", str(tmp_path / "corpus.txt"), "--config", str(tmp_path / "gemma3.toml")]
    argv += ["-o", str(tmp_path / "run"), "--max-steps", "30", "--batch-size", "8", "--lr", "3e-3"]
    argv += ["--eval-interval", "10", "--eval-batches", "1", "--warmup-steps", "5", "-q"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    cfg = load_checkpoint(tmp_path / "run").model_config
    assert (cfg.norm, cfg.norm_placement, cfg.mlp, cfg.head_dim, cfg.layer_pattern) == (
        "rmsnorm1p",
        "sandwich",
        "geglu",
        24,
        "LG",
    )
    records = MetricsLog(tmp_path / "run" / "metrics.jsonl").read()
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("shape", ["gemma3", "qwen3"])
def test_gemma3_and_qwen3_shaped_models_learn_and_resume_exactly(tmp_path: Path, shape: str) -> None:
    from lmcli.config.files import load_config_file

    if shape == "gemma3":
        (tmp_path / "g.toml").write_text(GEMMA3_TOML)
        model = ModelConfig(**load_config_file(tmp_path / "g.toml"))  # (the file holds model options only)
    else:
        model = QWEN3
    full = train(model, config(tmp_path, "full", max_steps=30), reporter=quiet(), progress=False)
    losses = [r["train_loss"] for r in MetricsLog(full.run_dir / "metrics.jsonl").read() if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.5
    cfg = config(tmp_path, "crashed", max_steps=30)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model, cfg, reporter=Reporter(info=lambda m: None, progress=CrashAt(15)), progress=False)
    resumed = train(model, cfg, resume=tmp_path / "crashed", reporter=quiet(), progress=False)
    assert_same_weights(weights(full.run_dir), weights(resumed.run_dir))
