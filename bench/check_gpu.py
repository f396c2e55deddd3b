"""``make check-gpu``: lmcli's CUDA paths, run for real on this machine's GPU, in about 10 minutes.

1. ``train``: a GPT-2-small-shaped model (12 layers, 12 heads, 768 wide, context 1024, byte
   tokenizer) for a few hundred steps with ``--compile``, bf16 autocast: tokens/s, MFU, peak
   memory against the pre-flight estimate;
2. ``torchrun``: a 1-process NCCL ``torchrun`` run of a smaller model, then ``resume``: the same
   run resumed under torchrun for a few more steps (the exit codes and the steps reached);
   ``fsdp`` and ``fsdp_resume``: the same with ``--parallel fsdp`` (bf16 parameters, float32
   gradient reduction, sharded DCP checkpoints) and ``--activation-checkpointing selective``;
3. ``eval``, ``sample``, ``beam`` in bf16 (the commands' precision policy) with the trained
   weights: tokens/s against Hugging Face transformers' GPT-2 holding the same weights under the
   same autocast, and whether both agree (perplexity, greedy tokens);
4. ``window``, ``kv_cache``, ``dpo``, ``grpo``, ``distill``: the paths added since
   (``bench/check_gpu_round.py``): sliding-window attention (SDPA, FlexAttention), 16-bit and
   block KV caches, and the post-training tasks, from the trained run.

Every figure goes into one JSON file (``bench/results/check_gpu.json`` by default). Without a
CUDA GPU it says so and exits 0. ``--device cpu --tiny`` runs the same plan on the CPU with a
tiny model and no torchrun (the test suite uses it to check the script itself).

    python -m bench.check_gpu [--out FILE] [--steps 300] [--device cuda|cpu] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.check_gpu_round import GPU_ROUND, ROUND_CHECKS, TINY_ROUND, RoundPlan, guarded, round_checks
from bench.texts import doc_text

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
TINY = {"n_layer": 1, "n_head": 1, "n_embd": 32, "block_size": 32}  # heads of 32: q8_0/q4_0 caches
TORCHRUN_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256}
CHECKS = ("train", "torchrun", "resume", "fsdp", "fsdp_resume", "eval", "sample", "beam", *ROUND_CHECKS)
GPU_ONLY = ("torchrun", "resume", "fsdp", "fsdp_resume")  # NCCL
FIGURES = ("tokens_per_s", "mfu", "ratio", "step", "exit_code", "worst", "wall_s", "error")  # printed
FSDP = ("--parallel", "fsdp", "--activation-checkpointing", "selective")


@dataclass
class Plan:
    """What one check run does: the device, the shapes, step counts and where results go."""

    device: str
    out: Path
    shape: dict[str, int]
    batch_size: int
    steps: int
    compile: bool
    torchrun: bool  # the NCCL torchrun run and its resume (CUDA only)
    torchrun_shape: dict[str, int]
    torchrun_steps: int
    new_tokens: int  # sampled per row (sample), generated at most (beam)
    eval_windows: int
    round: RoundPlan  # window, kv_cache, dpo, grpo, distill (bench/check_gpu_round.py)
    checks: list[str] = field(default_factory=lambda: list(CHECKS))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.check_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "check_gpu.json", help="the JSON report")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the GPT-2-small run")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and few steps (a dry run)")
    return parser.parse_args(argv)


def build_plan(args: argparse.Namespace) -> Plan:
    """The run the arguments ask for (pure: no device is touched)."""
    tiny = args.tiny
    return Plan(
        device=args.device,
        out=args.out,
        shape=dict(TINY if tiny else GPT2_SMALL),
        batch_size=4 if tiny else 8,
        steps=min(args.steps, 4) if tiny else args.steps,
        compile=not tiny,
        torchrun=args.device == "cuda",
        torchrun_shape=dict(TINY if tiny else TORCHRUN_SHAPE),
        torchrun_steps=4 if tiny else 40,
        new_tokens=8 if tiny else 128,
        eval_windows=2 if tiny else 32,
        round=TINY_ROUND if tiny else GPU_ROUND,
        checks=[c for c in CHECKS if args.device == "cuda" or c not in GPU_ONLY],
    )


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", memory_bytes=props.total_memory
        )
    return info


def write_report(path: Path, report: dict[str, Any]) -> None:
    """The JSON report, written whole (a temporary file renamed over the destination)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def corpus_file(folder: Path, chars: int) -> Path:
    """``chars`` characters of CPython's documentation (repeated as needed), as a corpus file."""
    text = doc_text()
    path = folder / "corpus.txt"
    path.write_text((text * (chars // len(text) + 1))[:chars])
    return path


# ----------------------------------------------------------------------------- the checks


def check_train(plan: Plan, work: Path, corpus: Path) -> dict[str, Any]:
    from lmcli.config.files import from_dict
    from lmcli.config.model import ModelConfig
    from lmcli.config.train import TrainConfig
    from lmcli.train import Reporter, train
    from lmcli.train.metrics import MetricsLog

    seen: dict[str, Any] = {}
    shape = {k: v for k, v in plan.shape.items()}
    options = dict(
        corpus=(str(corpus),),
        out=str(work / "train"),
        tokenizer="byte",
        cache_dir=str(work / "cache"),
        batch_size=plan.batch_size,
        max_steps=plan.steps,
        eval_interval=plan.steps,
        eval_batches=4,
        log_interval=max(plan.steps // 10, 1),
        warmup_steps=max(plan.steps // 10, 1),
        lr=6e-4,
        device=plan.device,
        compile=plan.compile,
    )
    cfg = from_dict(TrainConfig, options)
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(
        ModelConfig(dropout=0.0, **shape),
        cfg,
        reporter=Reporter(info=lambda m: None, preflight=lambda p, facts: seen.update(pre=p, facts=facts)),
        progress=False,
    )
    wall = time.perf_counter() - t0
    records = [r for r in MetricsLog(result.run_dir / "metrics.jsonl").read() if "train_loss" in r]
    steady = records[1:] or records  # the first log interval holds the compile
    out: dict[str, Any] = {
        "run": str(result.run_dir),
        "steps": result.step,
        "wall_s": wall,
        "first_loss": records[0]["train_loss"] if records else None,
        "last_loss": result.train_loss,
        "val_loss": result.val_loss,
        "tokens_per_s": _median([r["tokens_per_s"] for r in steady]),
        "mfu": _median([r["mfu"] for r in steady if r.get("mfu") is not None]),
        "mfu_against": seen.get("facts", {}).get("MFU against"),
        "preflight_memory_bytes": seen["pre"].memory_bytes if "pre" in seen else None,
    }
    if plan.device == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        if out["preflight_memory_bytes"]:
            out["estimate_over_peak"] = out["preflight_memory_bytes"] / out["peak_memory_bytes"]
    out["ok"] = result.step == plan.steps and math.isfinite(result.train_loss or math.nan)
    return out


def torchrun_argv(
    plan: Plan, corpus: Path, run: Path, resume: bool, extra: tuple[str, ...] = ()
) -> list[str]:
    """``torchrun`` (one process, NCCL on the GPU) of ``lmcli train``, or of its resume, with
    ``extra`` flags (FSDP's)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    if resume:
        return [
            *launch,
            "-m",
            "lmcli",
            "train",
            "--resume",
            str(run),
            "--max-steps",
            str(2 * plan.torchrun_steps),
            *extra,
            "-q",
        ]
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in plan.torchrun_shape.items()]
    return [
        *launch,
        *("-m", "lmcli", "train", str(corpus), "--out", str(run), "--tokenizer", "byte", *shape),
        *("--batch-size", str(plan.batch_size), "--max-steps", str(plan.torchrun_steps)),
        *("--eval-interval", str(plan.torchrun_steps), "--eval-batches", "2", "--device", plan.device, "-q"),
        *extra,
    ]


def check_torchrun(
    plan: Plan, corpus: Path, run: Path, resume: bool, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    argv = torchrun_argv(plan, corpus, run, resume, extra)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["LMCLI_CACHE"] = str(run.parent / "cache")
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out: dict[str, Any] = {"argv": argv[3:], "exit_code": done.returncode, "wall_s": time.perf_counter() - t0}
    meta = run / "last" / "meta.json"
    out["step"] = json.loads(meta.read_text())["step"] if meta.exists() else None
    want = plan.torchrun_steps * (2 if resume else 1)
    out["ok"] = done.returncode == 0 and out["step"] == want
    if not out["ok"]:
        out["stderr_tail"] = done.stderr[-2000:]
    return out


def _time(fn: Callable[[], Any], repeats: int = 2) -> tuple[float, Any]:
    """Best wall time of ``fn`` after a warm-up call (synchronizing a GPU), and its last result."""
    result = fn()
    best = math.inf
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, result


def check_inference(plan: Plan, run: Path, corpus: Path) -> dict[str, dict[str, Any]]:
    """eval, sample and beam with the trained weights in the commands' precision, against HF."""
    from bench.models import hf_twin
    from lmcli.config.commands import BeamConfig, SampleConfig
    from lmcli.device import inference_dtype, precision
    from lmcli.eval.perplexity import score_ids
    from lmcli.formats.sources import load_model
    from lmcli.generate.beam import beam_search
    from lmcli.generate.sampling import generate

    device = torch.device(plan.device)
    ckpt = load_model(run, device)
    model, tok = ckpt.model, ckpt.tokenizer
    amp = inference_dtype(device, "auto", torch.float32) or (torch.bfloat16 if plan.device == "cpu" else None)
    hf = hf_twin(model, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id).to(device).eval()
    T = model.config.block_size
    ids = [tok.bos_id, *tok.encode(corpus.read_text()[: 4 * T * plan.eval_windows])][
        : T * plan.eval_windows + 1
    ]
    prompt = ids[: T // 4]
    results: dict[str, dict[str, Any]] = {}
    with precision(device, amp), torch.inference_mode():
        # eval: non-overlapping windows, the NLL of every token
        t_lm, (count, nll) = _time(lambda: score_ids(model, ids, T, T))
        x = torch.tensor(ids[:-1], device=device).view(-1, T)
        y = torch.tensor(ids[1:], device=device).view(-1, T)

        def hf_eval() -> float:
            logits = hf(x).logits.float()
            return float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="sum"))

        t_hf, hf_nll = _time(hf_eval)
        results["eval"] = {
            "tokens": count,
            "lmcli_tokens_per_s": count / t_lm,
            "hf_tokens_per_s": count / t_hf,
            "ratio": t_hf / t_lm,
            "lmcli_loss": nll / count,
            "hf_loss": hf_nll / count,
            "ok": abs(nll - hf_nll) / count < 0.05,
        }
        # sample: the same number of new tokens on both sides (neither may stop early)
        n = plan.new_tokens
        cfg = SampleConfig(max_new_tokens=n, min_new_tokens=n, temperature=0.8, top_k=0, top_p=1.0, seed=0)
        t_lm, _ = _time(lambda: generate(model, tok, [prompt], cfg))
        p = torch.tensor([prompt], device=device)
        hf_kw = dict(pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
        lengths = dict(max_new_tokens=n, min_new_tokens=n, attention_mask=torch.ones_like(p))
        t_hf, _ = _time(lambda: hf.generate(p, do_sample=True, temperature=0.8, top_k=0, **lengths, **hf_kw))
        greedy = SampleConfig(max_new_tokens=n, min_new_tokens=n, temperature=0.0)
        ours = generate(model, tok, [prompt], greedy)[0].ids
        theirs = hf.generate(p, do_sample=False, **lengths, **hf_kw)[0, len(prompt) :].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours))
        results["sample"] = {
            "new_tokens": n,
            "lmcli_tokens_per_s": n / t_lm,
            "hf_tokens_per_s": n / t_hf,
            "ratio": t_hf / t_lm,
            "greedy_tokens_equal": same,  # bf16 arithmetic differs in the last bits: a prefix agrees
            "ok": same >= min(8, n),
        }
        # beam: 5 beams over a few prompts
        prompts = [ids[i * 4 : i * 4 + 12] for i in range(4)]
        bcfg = BeamConfig(beam_size=5, max_new_tokens=n // 2, early_stopping=True, length_penalty=1.0)
        t_lm, hyps = _time(lambda: beam_search(model, prompts, bcfg, eos_id=tok.eos_id, pad_id=tok.pad_id))
        idx = torch.tensor(prompts, device=device)
        beam_kw = dict(num_beams=5, early_stopping=True, length_penalty=1.0, do_sample=False)
        t_hf, _ = _time(
            lambda: hf.generate(
                idx, attention_mask=torch.ones_like(idx), max_new_tokens=n // 2, **beam_kw, **hf_kw
            )
        )
        made = sum(len(h[0].ids) for h in hyps)
        results["beam"] = {
            "inputs": len(prompts),
            "lmcli_tokens_per_s": made / t_lm,
            "hf_s": t_hf,
            "lmcli_s": t_lm,
            "ratio": t_hf / t_lm,
            "ok": all(h for h in hyps),
        }
    for r in results.values():
        r["dtype"] = str(amp).removeprefix("torch.") if amp else "float32"
    return results


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    if plan.device == "cuda" and not torch.cuda.is_available():
        print(
            "check-gpu: no CUDA GPU on this machine: nothing to check (run it where `nvidia-smi` shows a GPU)"
        )
        return 0
    shown = {**plan.__dict__, "round": dataclasses.asdict(plan.round), "out": str(plan.out)}
    report: dict[str, Any] = {"plan": shown, "environment": environment()}
    with tempfile.TemporaryDirectory(prefix="lmcli-check-gpu-") as tmp:
        work = Path(tmp)
        corpus = corpus_file(work, 40_000 if args.tiny else 4_000_000)
        report["train"] = check_train(plan, work, corpus)
        write_report(plan.out, report)
        if plan.torchrun:
            report["torchrun"] = check_torchrun(plan, corpus, work / "ddp", resume=False)
            report["resume"] = check_torchrun(plan, corpus, work / "ddp", resume=True)
            report["fsdp"] = check_torchrun(plan, corpus, work / "fsdp", resume=False, extra=FSDP)
            report["fsdp_resume"] = check_torchrun(plan, corpus, work / "fsdp", resume=True, extra=FSDP)
            write_report(plan.out, report)
        run = Path(report["train"]["run"])
        report.update(check_inference(plan, run, corpus))
        write_report(plan.out, report)
        for name, check in round_checks(plan.device, plan.round, work, corpus, run, plan.new_tokens).items():
            report[name] = guarded(check)  # an error is the check's entry: the others still run
            write_report(plan.out, report)
    report["ok"] = all(report[c]["ok"] for c in plan.checks)
    write_report(plan.out, report)
    for name in plan.checks:
        r = report[name]
        figures = {k: v for k, v in r.items() if k in FIGURES}
        print(f"{name:9} {'ok ' if r['ok'] else 'FAIL'} {json.dumps(figures)}")
    print(f"check-gpu: {'PASS' if report['ok'] else 'FAIL'}; every figure in {plan.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
