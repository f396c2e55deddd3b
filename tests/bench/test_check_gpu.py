"""`make check-gpu` (bench/check_gpu.py): its CPU-side logic, and a dry run of the whole plan on
the CPU with a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import check_gpu, check_gpu_round


def test_the_plan_of_a_gpu_run_and_of_a_cpu_dry_run(tmp_path: Path) -> None:
    gpu = check_gpu.build_plan(check_gpu.parse_args(["--out", str(tmp_path / "r.json"), "--steps", "250"]))
    assert gpu.device == "cuda" and gpu.compile and gpu.torchrun and gpu.steps == 250
    assert gpu.shape == {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}  # GPT-2 small
    new = ["window", "kv_cache", "dpo", "grpo", "distill"]  # the paths added since (issue 48)
    assert gpu.checks == [
        "train",
        "torchrun",
        "resume",
        "fsdp",
        "fsdp_resume",
        "eval",
        "sample",
        "beam",
        *new,
    ]
    assert gpu.round == check_gpu_round.GPU_ROUND
    dry = check_gpu.build_plan(check_gpu.parse_args(["--device", "cpu", "--tiny"]))
    assert not dry.torchrun and not dry.compile and dry.steps <= 4
    assert dry.checks == ["train", "eval", "sample", "beam", *new] and dry.round == check_gpu_round.TINY_ROUND


def test_torchrun_commands_run_one_nccl_process_then_resume(tmp_path: Path) -> None:
    plan = check_gpu.build_plan(check_gpu.parse_args([]))
    first = check_gpu.torchrun_argv(plan, tmp_path / "c.txt", tmp_path / "run", resume=False)
    again = check_gpu.torchrun_argv(plan, tmp_path / "c.txt", tmp_path / "run", resume=True)
    assert first[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    assert "--device" in first and first[first.index("--device") + 1] == "cuda"
    assert again[again.index("--resume") + 1] == str(tmp_path / "run")
    assert again[again.index("--max-steps") + 1] == str(2 * plan.torchrun_steps)
    sharded = check_gpu.torchrun_argv(plan, tmp_path / "c.txt", tmp_path / "run", True, check_gpu.FSDP)
    assert sharded[sharded.index("--parallel") + 1] == "fsdp", "a resume chooses its parallelism again"
    assert sharded[sharded.index("--activation-checkpointing") + 1] == "selective"


def test_the_report_is_written_whole(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "report.json"
    check_gpu.write_report(out, {"train": {"tokens_per_s": 1.5}, "path": tmp_path})
    assert json.loads(out.read_text()) == {"train": {"tokens_per_s": 1.5}, "path": str(tmp_path)}
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]  # no temporary left


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_gpu.main(["--out", str(tmp_path / "r.json")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_a_cpu_dry_run_fills_every_figure(tmp_path: Path, capsys) -> None:
    """The whole plan on the CPU (~35 s: nine training and tokenizing commands in processes of
    their own)."""
    out = tmp_path / "r.json"
    assert check_gpu.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and "PASS" in capsys.readouterr().out
    assert report["train"]["steps"] == 4 and report["train"]["mfu"] > 0
    assert report["train"]["preflight_memory_bytes"] > 0
    for name in ("eval", "sample", "beam"):
        assert report[name]["ratio"] > 0 and report[name]["dtype"] == "bfloat16", name
    assert abs(report["eval"]["lmcli_loss"] - report["eval"]["hf_loss"]) < 0.05
    for name in check_gpu_round.ROUND_CHECKS:
        assert report[name]["ok"] and report[name]["wall_s"] > 0 and report[name]["compares"], name
    assert set(report["window"]["errors"]) == {"float32", "bfloat16"}
    kv = report["kv_cache"]["results"]
    assert set(kv) == {"float32", "bfloat16"} and all(
        set(r) == set(check_gpu_round.KV_DTYPES) for r in kv.values()
    )
    steps = report["plan"]["round"]["steps"]
    dpo = report["dpo"]
    assert len(dpo["losses"]) == steps and dpo["loss_fell"] and dpo["margins"][-1] > dpo["margins"][0]
    assert dpo["resumed_error"] == 0.0  # on the CPU a resume is bit-identical
    assert len(report["grpo"]["losses"]) == len(report["grpo"]["rewards"]) == steps
    distill = report["distill"]
    for kl in ("online_kl", "offline_kl"):
        assert distill[kl][-1] < distill[kl][0], kl
    assert len(distill["sampled_kl"]) == steps


def test_the_window_check_compares_every_attention_path() -> None:
    out = check_gpu_round.check_window("cpu", check_gpu_round.TINY_ROUND)
    assert out["ok"] and out["documents_mask"] == "Tensor"  # (a BlockMask: FlexAttention, on CUDA)
    paths = ("window", "window_documents", "documents")
    want = {f"{p}_{what}" for p in paths for what in ("logits", "grad")} | {
        "cached_full_cache",
        "cached_ring",
    }
    assert set(out["errors"]["float32"]) == set(out["errors"]["bfloat16"]) == want
    assert out["worst"]["float32"] < 1e-5  # the CPU against itself in float32; decoding to rounding
    assert 0 < out["worst"]["bfloat16"] <= check_gpu_round.WINDOW_TOLERANCE["bfloat16"]


def test_the_window_check_fails_when_the_forward_forgets_the_window(monkeypatch) -> None:
    """A forward whose local layers see the whole context (their mask not narrowed): the window's
    ring, which keeps only the window, then decodes otherwise, and the check says so."""
    from lmcli.model.transformer import Transformer

    def unnarrowed(self, mask, is_causal, T, cache, device):
        ring = cache.window_mask(T) if cache is not None else None
        return (ring, False) if ring is not None else (mask, is_causal)

    monkeypatch.setattr(Transformer, "local_mask", unnarrowed)
    out = check_gpu_round.check_window("cpu", check_gpu_round.TINY_ROUND)
    assert not out["ok"] and out["errors"]["float32"]["cached_ring"] > 0.05
    assert out["errors"]["float32"]["cached_full_cache"] < 1e-5


def test_a_check_that_raises_is_a_failed_entry_and_the_curve_tests() -> None:
    entry = check_gpu_round.guarded(lambda: 1 / 0)
    assert (
        not entry["ok"] and entry["error"] == "ZeroDivisionError: division by zero" and entry["wall_s"] >= 0
    )
    assert check_gpu_round.falls([0.7, 0.69, 0.6, 0.5, 0.4, 0.41])
    assert not check_gpu_round.falls([0.5, 0.6]) and not check_gpu_round.falls([0.5])
    assert check_gpu_round.preference_rows(4)[0]["prompt"].startswith("up ")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model trained until its next tokens are far from uniform (heads of 32 values: the
    block caches' least), and its corpus (the prompt comes from it)."""
    from helpers import TINY_TEXT

    from lmcli.cli.app import main

    tmp = tmp_path_factory.mktemp("kv")
    (tmp / "corpus.txt").write_text(TINY_TEXT)
    argv = [
        *("train", str(tmp / "corpus.txt"), "--out", str(tmp / "run"), "--tokenizer", "char", "--lr", "1e-2"),
        *("--n-layer", "1", "--n-head", "1", "--n-embd", "32", "--block-size", "32", "--max-steps", "40"),
        *("--batch-size", "8", "--eval-interval", "40", "--eval-batches", "1", "--warmup-steps", "2"),
        *("--threads", "1", "--cache-dir", str(tmp / "cache"), "-q"),
    ]
    try:
        main(argv)
    except SystemExit as done:
        assert not done.code
    return tmp / "run", tmp / "corpus.txt"


def test_the_kv_cache_check_compares_every_cache_dtype(trained_run: tuple[Path, Path]) -> None:
    out = check_gpu_round.check_kv_cache("cpu", *trained_run, 8)
    assert out["ok"] and set(out["results"]) == {"float32", "bfloat16"}
    for rows in out["results"].values():
        assert set(rows) == set(check_gpu_round.KV_DTYPES)
        assert all(r["agrees"] in ("text", "logits") for r in rows.values())
        assert all(r["logits_error"] <= r["tolerance"] for r in rows.values())


def test_the_kv_cache_check_fails_when_a_block_cache_reads_back_wrong(trained_run, monkeypatch) -> None:
    """Blocks read back as zeros (keys and values lost): q8_0 and q4_0 disagree in text and logits."""
    from lmcli.model import kv_cache

    monkeypatch.setattr(kv_cache, "dequantize_rows", lambda b, fmt, n: torch.zeros(*b.shape[:-1], n))
    out = check_gpu_round.check_kv_cache("cpu", *trained_run, 8)
    assert not out["ok"]
    for rows in out["results"].values():
        assert rows["q8_0"]["agrees"] == rows["q4_0"]["agrees"] == "no", rows
        assert rows["bfloat16"]["agrees"] != "no"
