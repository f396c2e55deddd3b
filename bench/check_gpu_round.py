"""The checks ``make check-gpu`` (``bench/check_gpu.py``) runs for the paths added after it was
written: sliding windows, 16-bit and block KV caches, DPO, GRPO and distillation.

1. ``window``: a Gemma-3-shaped model with random weights (local and global layers, a sliding
   window, rotary positions with a local base, QK-norm, sandwich norms) on the device, in float32
   and under bf16 autocast, against the same weights in float32 on the CPU: logits and the
   gradient of the first attention projection of a forward with the window (SDPA with its mask),
   of packed documents under the window (a boolean mask), and of packed documents without a
   window (FlexAttention's ``BlockMask`` on CUDA, a boolean mask elsewhere); then a decode one
   token at a time through the KV cache, past the window (a full cache and the window's ring),
   against the full forward's logits on the device;
2. ``kv_cache``: the trained run of ``train``, greedy decoding and teacher-forced logits with the
   cache in bfloat16, float16, q8_0 and q4_0 against a float32 cache, in float32 and in the
   commands' autocast;
3. ``dpo``: ``lmcli train --task dpo`` from the trained run under bf16 autocast: losses finite and
   falling, and a run stopped half-way then resumed equals the uninterrupted one;
4. ``grpo``: ``lmcli train --task grpo`` from the trained run: every loss and reward finite;
5. ``distill``: ``lmcli train --task distill --teacher`` (the trained run), then ``lmcli tokenize
   --teacher --top-k 8`` and a student trained from those offline logits: both KLs fall; and
   ``--logits sampled`` (8 tokens drawn on the device) and a student from them: its estimated KL
   finite (a token drawn without mass would make it infinite; a student this close to a barely
   trained teacher sits at the estimate's noise, so it is not asked to fall).

Each check returns its figures, what it compared with which tolerance, and ``ok``; an exception
is recorded as the check's ``error`` (one failing path does not hide the others).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
ROUND_CHECKS = ("window", "kv_cache", "dpo", "grpo", "distill")
# Gemma 3's block (bench-sized: the window and shape come from the RoundPlan)
GEMMA3 = dict(
    position="rope", rope_local_base=10000.0, norm="rmsnorm1p", norm_placement="sandwich", mlp="geglu",
    bias=False, qk_norm=True, scale_embeddings=True, dropout=0.0, vocab_size=512,
)  # fmt: skip
# max |difference| over max |reference| of logits or gradients, by the dtype the device computes in
# (float32 on CUDA runs TF32 matmuls: torch.set_float32_matmul_precision("high"))
WINDOW_TOLERANCE = {"float32": 1e-2, "bfloat16": 6e-2}
KV_DTYPES = ("bfloat16", "float16", "q8_0", "q4_0")
# the largest rounding error of one value stored (or computed) in a dtype, relative to the largest
# value of its row (half a unit in the last place; q8_0: half its step of amax/127; q4_0: amax/8)
ROUNDING = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11, "q8_0": 1 / 254, "q4_0": 1 / 16}


def kv_tolerance(cache: str, compute: str) -> float:
    """The bound of a cache's teacher-forced logits against a float32 cache's, in the measure of
    ``relative``: twice the rounding of a cached value plus that of the dtype computing (a trained
    tiny model shows 0.2 to 0.5 of the cache's part)."""
    return 2 * (ROUNDING[cache] + ROUNDING[compute])


# relative, of each loss after a resume (bit-identical on the CPU; CUDA's backward kernels may add
# in another order: docs/gpu.md, determinism)
RESUME_TOLERANCE = 1e-2


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """The sizes of this round's checks: a GPU's, or a CPU dry run's (tiny)."""

    window_shape: dict[str, Any]
    rows: int  # window: sequences a forward
    steps: int  # dpo, grpo and distill: training steps
    post_lr: float  # dpo and grpo, from the trained run
    student_shape: dict[str, int]
    distill_lr: float
    distill_chars: int  # of the corpus, for distillation
    cpu_threads: bool  # pass --threads 1 to the commands (a dry run on a shared CPU)


GPU_ROUND = RoundPlan(
    window_shape=dict(
        n_layer=6,
        layer_pattern="LLLLLG",
        sliding_window=128,
        n_head=4,
        n_kv_head=2,
        n_embd=256,
        block_size=512,
    ),
    rows=4,
    steps=40,
    post_lr=1e-4,
    student_shape=dict(n_layer=4, n_head=4, n_embd=256, block_size=256),
    distill_lr=3e-3,
    distill_chars=400_000,
    cpu_threads=False,
)
TINY_ROUND = RoundPlan(
    window_shape=dict(
        n_layer=3, layer_pattern="LLG", sliding_window=8, n_head=2, n_kv_head=1, n_embd=64, block_size=32
    ),
    rows=2,
    steps=8,
    post_lr=3e-3,
    student_shape=dict(n_layer=1, n_head=2, n_embd=32, block_size=16),
    distill_lr=1e-2,
    distill_chars=6_000,
    cpu_threads=True,
)


def round_checks(
    device: str, plan: RoundPlan, work: Path, corpus: Path, run: Path, new_tokens: int
) -> dict[str, Callable[[], dict[str, Any]]]:
    """Every check of this round on ``device``, from the trained ``run``, by name (run each
    through ``guarded``)."""
    return {
        "window": lambda: check_window(device, plan),
        "kv_cache": lambda: check_kv_cache(device, run, corpus, new_tokens),
        "dpo": lambda: check_dpo(device, plan, work, run),
        "grpo": lambda: check_grpo(device, plan, work, run),
        "distill": lambda: check_distill(device, plan, work, run, corpus),
    }


def guarded(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``check()``'s entry with its wall time; a failed entry with the error if it raises."""
    t0 = time.perf_counter()
    try:
        out = check()
    except Exception as exc:  # a path that breaks on this device is a finding, not the end of the run
        out = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-3000:],
        }
    out["wall_s"] = time.perf_counter() - t0
    return out


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (both read as float32 on the CPU)."""
    a, ref = a.detach().float().cpu(), ref.detach().float().cpu()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------- window


def forward_and_grad(
    model: Any, idx: torch.Tensor, document: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training's forward of ``idx`` (B, T) (with ``document`` ids: packed documents): its logits
    and the gradient of the first attention projection under the next-token loss."""
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(idx, document=document)  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    grad = model.h[0].attn.c_attn.weight.grad
    model.eval()
    return logits.detach().float(), grad.detach().float()


def cached_steps(model: Any, idx: torch.Tensor, slack: int | None) -> torch.Tensor:
    """Logits (B, T, V) of ``idx`` fed one token at a time through a KV cache (``slack`` None: a
    full cache; 0: the window's ring for the local layers)."""
    from lmcli.model.kv_cache import KVCache

    cache = KVCache.for_model(model, idx.size(0), window_slack=slack)
    return torch.cat([model(idx[:, t : t + 1], cache) for t in range(idx.size(1))], dim=1).float()


def window_models(plan: RoundPlan) -> tuple[Any, Any]:
    """The Gemma-3-shaped windowed model (random weights, seed 0, float32 on the CPU) and the
    same weights without a window (every layer global)."""
    from lmcli.config.model import ModelConfig
    from lmcli.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(**GEMMA3, **plan.window_shape)
    windowed = Transformer(cfg).eval()
    flat = Transformer(dataclasses.replace(cfg, sliding_window=0, layer_pattern="")).eval()
    flat.load_state_dict(windowed.state_dict())
    return windowed, flat


def check_window(device_name: str, plan: RoundPlan) -> dict[str, Any]:
    import copy

    from lmcli.device import precision
    from lmcli.model.documents import document_mask

    device = torch.device(device_name)
    windowed, flat = window_models(plan)
    cfg = windowed.config
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (plan.rows, cfg.block_size), generator=gen)
    starts = torch.rand(idx.shape, generator=gen) < 4 / cfg.block_size  # about 4 documents a row
    starts[:, 0] = True
    document = starts.cumsum(1)  # (B, T) each token's document number
    paths = {
        "window": (windowed, None),
        "window_documents": (windowed, document),
        "documents": (flat, document),
    }
    ref = {name: forward_and_grad(model, idx, doc) for name, (model, doc) in paths.items()}
    on = {name: (copy.deepcopy(model).to(device), doc) for name, (model, doc) in paths.items()}
    dev_idx, dev_doc = idx.to(device), document.to(device)
    out: dict[str, Any] = {
        "compares": "logits and the first attention projection's gradient on the device against "
        "float32 on the CPU; cached decoding against the full forward on the device",
        "shape": {**plan.window_shape, "rows": plan.rows},
        "documents_mask": type(document_mask(dev_doc, plain=False)).__name__,  # BlockMask: FlexAttention
        "tolerance": WINDOW_TOLERANCE,
        "errors": {},
    }
    for dtype in ("float32", "bfloat16"):
        amp = None if dtype == "float32" else torch.bfloat16
        errors: dict[str, float] = {}
        with precision(device, amp):
            for name, (model, doc) in on.items():
                logits, grad = forward_and_grad(model, dev_idx, None if doc is None else dev_doc)
                errors[f"{name}_logits"] = relative(logits, ref[name][0])
                errors[f"{name}_grad"] = relative(grad, ref[name][1])
            model = on["window"][0]
            with torch.inference_mode():
                full = model(dev_idx).float()
                errors["cached_full_cache"] = relative(cached_steps(model, dev_idx, None), full)
                errors["cached_ring"] = relative(cached_steps(model, dev_idx, 0), full)
        out["errors"][dtype] = errors
    out["worst"] = {d: max(e.values()) for d, e in out["errors"].items()}
    out["ok"] = all(out["worst"][d] <= WINDOW_TOLERANCE[d] for d in out["worst"])
    return out


# ----------------------------------------------------------------------------- KV cache dtypes


def teacher_forced(model: Any, ids: list[int], n_prompt: int, dtype: Any) -> torch.Tensor:
    """Logits (n, V) of every token after the prompt's last, fed through a cache of ``dtype``
    (the prompt at once, then one token at a time)."""
    from lmcli.model.kv_cache import KVCache

    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    cache = KVCache.for_model(model, 1, max_len=len(ids), dtype=dtype)
    steps = [model(x[:, :n_prompt], cache, last_only=True)]
    steps += [model(x[:, t : t + 1], cache) for t in range(n_prompt, len(ids) - 1)]
    return torch.cat(steps, dim=1)[0].float()


def check_kv_cache(device_name: str, run: Path, corpus: Path, n: int) -> dict[str, Any]:
    from lmcli.config.commands import SampleConfig
    from lmcli.device import inference_dtype, precision
    from lmcli.formats.sources import load_model
    from lmcli.generate.sampling import generate
    from lmcli.model.kv_cache import check_format, kv_dtype

    device = torch.device(device_name)
    ckpt = load_model(run, device)
    model, tok = ckpt.model, ckpt.tokenizer
    # the commands' autocast (bf16 on a GPU); a CPU dry run takes bf16 autocast in its place
    amp = inference_dtype(device, "auto", torch.float32) or torch.bfloat16
    prompt = [tok.bos_id, *tok.encode(corpus.read_text()[:400])][: model.config.block_size // 4]
    greedy = SampleConfig(max_new_tokens=n, min_new_tokens=n, temperature=0.0)
    out: dict[str, Any] = {
        "compares": "greedy tokens and teacher-forced logits with each cache dtype against a float32 "
        "cache, in float32 and in the commands' autocast",
        "new_tokens": n,
        "tolerance": "2 * (the cache dtype's rounding + the compute dtype's): each row's tolerance",
        "results": {},
    }
    for precision_name, autocast in (("float32", None), (str(amp).removeprefix("torch."), amp)):
        rows: dict[str, Any] = {}
        with precision(device, autocast), torch.inference_mode():
            model.kv_dtype = torch.float32
            want = generate(model, tok, [prompt], greedy)[0].ids
            ids = [*prompt, *want]
            ref = teacher_forced(model, ids, len(prompt), torch.float32)
            for name in KV_DTYPES:
                dtype = kv_dtype(name)
                check_format(dtype, model.config.head_dim)
                model.kv_dtype = dtype
                got = generate(model, tok, [prompt], greedy)[0].ids
                same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(want))
                error = relative(teacher_forced(model, ids, len(prompt), dtype), ref)
                bound = kv_tolerance(name, precision_name)
                agrees = "text" if same == len(want) else "logits" if error <= bound else "no"
                rows[name] = {
                    "greedy_tokens_equal": same,
                    "logits_error": error,
                    "tolerance": bound,
                    "agrees": agrees,
                }
        model.kv_dtype = None
        out["results"][precision_name] = rows
    out["ok"] = all(r["agrees"] != "no" for rows in out["results"].values() for r in rows.values())
    return out


# ----------------------------------------------------------------------------- training tasks


def lmcli(argv: list[str], work: Path) -> dict[str, Any]:
    """``python -m lmcli ARGV`` in a process of its own: its exit code, wall time, stderr's tail."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["LMCLI_CACHE"] = str(work / "cache")
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lmcli", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    out = {"argv": argv, "exit_code": done.returncode, "wall_s": time.perf_counter() - t0}
    if done.returncode:
        out["stderr_tail"] = done.stderr[-2000:]
    return out


def records(run: Path, key: str) -> list[float]:
    """``key`` of every training record of ``run``'s metrics.jsonl, in step order."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r[key] for r in rows if key in r and "step" in r]


def falls(values: list[float]) -> bool:
    """Whether the mean of the last third is below the mean of the first third."""
    k = max(len(values) // 3, 1)
    return len(values) >= 2 and sum(values[-k:]) / k < sum(values[:k]) / k


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def task_flags(device: str, plan: RoundPlan, steps: int) -> list[str]:
    """What every training run of this round shares: the device, bf16 autocast, a constant
    learning rate (a resume then equals an uninterrupted run), a record every step."""
    return [
        *("--device", device, "--dtype", "bfloat16", "--max-steps", str(steps), "--log-interval", "1"),
        *("--warmup-steps", "0", "--min-lr-ratio", "1", "--eval-interval", str(steps), "--eval-batches", "1"),
        *(("--threads", "1") if plan.cpu_threads else ()),
        "-q",
    ]


def preference_rows(n: int) -> list[dict[str, str]]:
    """Pairs whose preferred reply depends on the prompt: after "up" a reply of the letters a-d is
    chosen over one of w-z, after "down" the other way round."""
    rng = random.Random(0)

    def word(letters: str) -> str:
        return "".join(rng.choice(letters) for _ in range(4))

    rows = []
    for i in range(n):
        good, bad = ("abcd", "wxyz") if i % 2 == 0 else ("wxyz", "abcd")
        prompt = f"{'up' if i % 2 == 0 else 'down'} {word('mnop')}"
        rows.append({"prompt": prompt, "chosen": word(good), "rejected": word(bad)})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_dpo(device: str, plan: RoundPlan, work: Path, base: Path) -> dict[str, Any]:
    pairs = write_jsonl(work / "pairs.jsonl", preference_rows(16))
    n = plan.steps
    task = [
        "--task",
        "dpo",
        str(pairs),
        "--init-from",
        str(base),
        "--lr",
        str(plan.post_lr),
        "--batch-size",
        "8",
    ]
    runs = {
        "whole": lmcli(["train", *task, "--out", str(work / "dpo"), *task_flags(device, plan, n)], work),
        "half": lmcli(
            ["train", *task, "--out", str(work / "dpo_half"), *task_flags(device, plan, n // 2)], work
        ),
    }
    runs["resumed"] = lmcli(["train", "--resume", str(work / "dpo_half"), "--max-steps", str(n), "-q"], work)
    loss, margin = records(work / "dpo", "train_loss"), records(work / "dpo", "margin")
    resumed = records(work / "dpo_half", "train_loss")
    after = (
        max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(resumed[n // 2 :], loss[n // 2 :], strict=True))
        if len(resumed) == len(loss) == n
        else None
    )
    return {
        "compares": "DPO losses finite and falling (mean of the last third below the first third's); "
        "the losses of a run stopped half-way and resumed against the uninterrupted run's",
        "runs": runs,
        "losses": loss,
        "margins": margin,
        "loss_fell": falls(loss),
        "margin_rose": falls([-m for m in margin]),
        "resumed_error": after,  # the largest relative difference over the resumed steps
        "resume_tolerance": RESUME_TOLERANCE,
        "ok": all(r["exit_code"] == 0 for r in runs.values())
        and len(loss) == n
        and finite(loss)
        and falls(loss)
        and after is not None
        and after <= RESUME_TOLERANCE,
    }


REWARD = "def a_share(prompt, reply, row):\n    return reply.count('a') / max(len(reply), 1)\n"


def check_grpo(device: str, plan: RoundPlan, work: Path, base: Path) -> dict[str, Any]:
    prompts = write_jsonl(
        work / "prompts.jsonl", [{"prompt": "mnop"[i % 4] + "nop"[i % 3]} for i in range(8)]
    )
    (work / "reward.py").write_text(REWARD)
    run = lmcli(
        [
            *("train", "--task", "grpo", str(prompts), "--val", str(prompts), "--init-from", str(base)),
            *("--out", str(work / "grpo")),
            *("--reward", f"{work / 'reward.py'}:a_share", "--group-size", "4", "--max-new-tokens", "8"),
            *("--batch-size", "4", "--lr", str(plan.post_lr), *task_flags(device, plan, plan.steps)),
        ],
        work,
    )
    loss, reward = records(work / "grpo", "train_loss"), records(work / "grpo", "reward")
    return {
        "compares": "every GRPO step's loss and mean reward finite (a few steps are too few to ask "
        "the reward to rise: its course is reported)",
        "run": run,
        "losses": loss,
        "rewards": reward,
        "reward_rose": falls([-r for r in reward]),
        "ok": run["exit_code"] == 0 and len(loss) == plan.steps and finite(loss) and finite(reward),
    }


def check_distill(device: str, plan: RoundPlan, work: Path, teacher: Path, corpus: Path) -> dict[str, Any]:
    text = work / "distill.txt"
    text.write_text(corpus.read_text()[: plan.distill_chars])
    student = [f"--{k.replace('_', '-')}={v}" for k, v in plan.student_shape.items()]
    train = [
        *student,
        "--lr",
        str(plan.distill_lr),
        "--batch-size",
        "8",
        *task_flags(device, plan, plan.steps),
    ]
    block = str(plan.student_shape["block_size"])
    runs = {
        "online": lmcli(
            [
                "train",
                "--task",
                "distill",
                str(text),
                "--teacher",
                str(teacher),
                "--out",
                str(work / "distill"),
                *train,
            ],
            work,
        ),
        "tokenize": lmcli(
            [
                *("tokenize", str(text), "--teacher", str(teacher), "--top-k", "8", "--block-size", block),
                *("--device", device, "-o", str(work / "tok"), "-q"),
            ],
            work,
        ),
    }
    runs["tokenize_sampled"] = lmcli(
        [
            *("tokenize", str(text), "--teacher", str(teacher), "--top-k", "8", "--logits", "sampled"),
            *("--block-size", block, "--device", device, "-o", str(work / "tok_sampled"), "-q"),
        ],
        work,
    )
    for name, tokens in (("offline", "tok"), ("offline_sampled", "tok_sampled")):
        runs[name] = lmcli(
            [
                *("train", "--task", "distill", str(work / tokens), "--teacher", str(teacher)),
                *("--out", str(work / f"distill_{name}"), *train),
            ],
            work,
        )
    online, offline = records(work / "distill", "kl"), records(work / "distill_offline", "kl")
    sampled = records(work / "distill_offline_sampled", "kl")
    return {
        "compares": "the student's KL to the teacher finite and falling (mean of the last third below "
        "the first third's), online and from offline top-8 logits; from 8 tokens drawn a position "
        "(sampled logits), the estimated KL finite",
        "runs": runs,
        "online_kl": online,
        "offline_kl": offline,
        "sampled_kl": sampled,
        "ok": all(r["exit_code"] == 0 for r in runs.values())
        and all(len(k) == plan.steps and finite(k) and falls(k) for k in (online, offline))
        and len(sampled) == plan.steps
        and finite(sampled),
    }
