"""`make check-gpu` (bench/check_gpu.py): its CPU-side logic, and a dry run of the whole plan on
the CPU with a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench import check_gpu


def test_the_plan_of_a_gpu_run_and_of_a_cpu_dry_run(tmp_path: Path) -> None:
    gpu = check_gpu.build_plan(check_gpu.parse_args(["--out", str(tmp_path / "r.json"), "--steps", "250"]))
    assert gpu.device == "cuda" and gpu.compile and gpu.torchrun and gpu.steps == 250
    assert gpu.shape == {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}  # GPT-2 small
    assert gpu.checks == ["train", "torchrun", "resume", "fsdp", "fsdp_resume", "eval", "sample", "beam"]
    dry = check_gpu.build_plan(check_gpu.parse_args(["--device", "cpu", "--tiny"]))
    assert not dry.torchrun and not dry.compile and dry.steps <= 4
    assert dry.checks == ["train", "eval", "sample", "beam"]


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


def test_a_cpu_dry_run_fills_every_figure(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    assert check_gpu.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and "PASS" in capsys.readouterr().out
    assert report["train"]["steps"] == 4 and report["train"]["mfu"] > 0
    assert report["train"]["preflight_memory_bytes"] > 0
    for name in ("eval", "sample", "beam"):
        assert report[name]["ratio"] > 0 and report[name]["dtype"] == "bfloat16", name
    assert abs(report["eval"]["lmcli_loss"] - report["eval"]["hf_loss"]) < 0.05
