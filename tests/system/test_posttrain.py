"""`lmcli train --task dpo|grpo`: DPO raises a tiny model's held-out preference accuracy from about
0.5 to >= 0.9 (every loss, LoRA, a precomputed reference); GRPO raises the mean reward of a tiny
verifiable task; a run that crashes resumes to the very weights of an uninterrupted one; bad rows
and options are one line."""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    CrashAt,
    assert_one_line_error,
    kill_after_checkpoint,
    make_run,
    read_metrics,
    run_cli,
    saved_step,
    train_config,
)
from safetensors.torch import load_file

from lmcli.cli.app import main
from lmcli.config.model import ModelConfig
from lmcli.train import Reporter, train

ALPHABET = "abcdwxyzmnop updown system user assistant "
QUIET = Reporter(info=lambda msg: None)
FAST = ("--batch-size", "8", "--warmup-steps", "2", "--threads", "1", "-q")


def preference_rows(n: int, seed: int) -> list[dict]:
    """Pairs whose rule depends on the prompt: after "up" the chosen reply is made of a-d and the
    rejected one of w-z, after "down" the other way round (a model that merely prefers one
    alphabet is right half of the time)."""
    rng = random.Random(seed)
    word = lambda letters: "".join(rng.choice(letters) for _ in range(4))  # noqa: E731
    rows = []
    for _ in range(n):
        up = rng.random() < 0.5
        good, bad = ("abcd", "wxyz") if up else ("wxyz", "abcd")
        rows.append(
            {
                "prompt": f"{'up' if up else 'down'} {word('mnop')}",
                "chosen": word(good),
                "rejected": word(bad),
            }
        )
    return rows


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny base model (``base``), pairs (``pairs.jsonl``, ``val.jsonl``), prompts and a
    reward function (``prompts.jsonl``, ``reward.py``)."""
    tmp = tmp_path_factory.mktemp("post")
    make_run(tmp / "base", text=ALPHABET * 3)
    write_jsonl(tmp / "pairs.jsonl", preference_rows(200, 0))
    write_jsonl(tmp / "val.jsonl", preference_rows(40, 1))
    rng = random.Random(2)
    write_jsonl(
        tmp / "prompts.jsonl", [{"prompt": "".join(rng.choice("mnop") for _ in range(3))} for _ in range(60)]
    )
    (tmp / "reward.py").write_text(
        "def a_share(prompt, reply, row):\n    return reply.count('a') / max(len(reply), 1)\n"
    )
    return tmp


def accuracy(capsys, model: Path, pairs: Path, *reference: str) -> float:
    code, out, err = run_cli(["eval", str(model), "--preferences", str(pairs), *reference, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)["accuracy"]


def dpo_args(setup: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("train", "--task", "dpo", str(setup / "pairs.jsonl"), "--val", str(setup / "val.jsonl")),
        *("--init-from", str(setup / "base"), "--out", str(out), "--lr", "3e-3", "--max-steps", "40"),
        *("--eval-interval", "20", "--log-interval", "10", *FAST, *extra),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        (),
        ("--preference-loss", "ipo"),
        ("--preference-loss", "simpo", "--beta", "2"),
        ("--precompute-reference",),
    ],
)
def test_dpo_raises_held_out_preference_accuracy(setup: Path, tmp_path: Path, capsys, options) -> None:
    before = accuracy(capsys, setup / "base", setup / "val.jsonl")
    assert 0.2 <= before <= 0.8  # a random model has no preference
    code, _, err = run_cli(dpo_args(setup, tmp_path / "dpo", *options), capsys)
    assert code == 0, err
    assert accuracy(capsys, tmp_path / "dpo", setup / "val.jsonl") >= 0.9
    records = read_metrics(tmp_path / "dpo")
    train_logs = [r for r in records if "margin" in r]
    assert train_logs[-1]["margin"] > train_logs[0]["margin"] and "reward_chosen" in train_logs[0]
    val = [r for r in records if "val_accuracy" in r]
    assert val[-1]["val_accuracy"] >= 0.9 and (tmp_path / "dpo" / "loss.png").exists()


@pytest.mark.slow
def test_dpo_with_lora_against_its_base(setup: Path, tmp_path: Path, capsys) -> None:
    """(Adapters on the blocks of this random base learn the rule slowly; with the embedding
    training too the reference is a frozen copy. The adapters-off reference is exact:
    tests/train/test_reference.py, and resumes exactly: below.)"""
    lora = ("--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--lora-train-embeddings")
    code, _, err = run_cli(dpo_args(setup, tmp_path / "lora", *lora), capsys)
    assert code == 0, err
    assert accuracy(capsys, tmp_path / "lora", setup / "val.jsonl") >= 0.9
    # against the base, the implicit rewards of the LoRA run put the chosen reply first too
    assert accuracy(capsys, tmp_path / "lora", setup / "val.jsonl", "--reference", str(setup / "base")) >= 0.9


def grpo_args(setup: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("train", "--task", "grpo", str(setup / "prompts.jsonl"), "--init-from", str(setup / "base")),
        *("--reward", f"{setup / 'reward.py'}:a_share", "--out", str(out), "--lr", "3e-3"),
        *("--max-steps", "30", "--group-size", "8", "--max-new-tokens", "8", "--eval-interval", "10"),
        *("--eval-batches", "2", "--log-interval", "5", *FAST, "--batch-size", "4", *extra),
    ]


def test_grpo_raises_the_mean_reward(setup: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(grpo_args(setup, tmp_path / "grpo"), capsys)
    assert code == 0, err
    records = read_metrics(tmp_path / "grpo")
    rewards = [r["reward"] for r in records if "reward" in r]
    assert rewards[-1] > rewards[0] + 0.1
    assert all(0 <= r["groups_with_spread"] <= 1 and r["reply_tokens"] > 0 for r in records if "reward" in r)
    val = [r["val_reward"] for r in records if "val_reward" in r]
    assert val[-1] > val[0] and (tmp_path / "grpo" / "best").exists()


def saved_tensors(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``run/last``'s safetensors files (weights, adapters)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted((run / "last").glob("*.safetensors")):
        out.update({f"{file.name}:{k}": v for k, v in load_file(str(file)).items()})
    return out


RESUMED = {
    "dpo": dict(task="dpo", val="val.jsonl", corpus=("pairs.jsonl",)),
    "dpo-precomputed": dict(task="dpo", val="val.jsonl", corpus=("pairs.jsonl",), precompute_reference=True),
    "dpo-lora": dict(task="dpo", val="val.jsonl", corpus=("pairs.jsonl",), lora_rank=2, lora_dropout=0.1),
    "grpo": dict(
        task="grpo", corpus=("prompts.jsonl",), reward=("reward.py:a_share",), group_size=4, max_new_tokens=6,
        kl_coef=0.05, grpo_steps=2, batch_size=3,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RESUMED))
def test_resume_after_a_crash_equals_an_uninterrupted_run(setup: Path, tmp_path: Path, kind: str) -> None:
    options = dict(RESUMED[kind])
    for key in ("val",):
        if key in options:
            options[key] = str(setup / options[key])
    options["corpus"] = tuple(str(setup / c) for c in options["corpus"])
    if "reward" in options:
        options["reward"] = tuple(str(setup / r) for r in options["reward"])
    common = dict(
        init_from=str(setup / "base"), max_steps=12, eval_interval=4, eval_batches=1, log_interval=2
    )
    common.update(lr=3e-3, warmup_steps=2, seed=3, batch_size=options.pop("batch_size", 4))
    model = ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)  # the base's shape (make_run)
    full = train(
        model, train_config(**common, **options, out=str(tmp_path / "full")), reporter=QUIET, progress=False
    )
    cfg = train_config(**common, **options, out=str(tmp_path / "crashed"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(model, cfg, reporter=Reporter(info=lambda m: None, progress=CrashAt(6)), progress=False)
    resumed = train(model, cfg, resume=tmp_path / "crashed", reporter=QUIET, progress=False)
    assert resumed.step == full.step == 12
    a, b = saved_tensors(full.run_dir), saved_tensors(resumed.run_dir)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    full_log = [r for r in read_metrics(full.run_dir) if "train_loss" in r]
    resumed_log = [r for r in read_metrics(resumed.run_dir) if "train_loss" in r]
    drop = ("elapsed", "tokens_per_s", "mfu")
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed_log] == [
        {k: v for k, v in r.items() if k not in drop} for r in full_log
    ]


# ----------------------------------------------------------------------------- bad rows and options


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "up mnop", "chosen": "abcd"}, 'pairs.jsonl:3: no "rejected" reply'),
        ({"prompt": "up", "chosen": "", "rejected": "wxyz"}, 'pairs.jsonl:3: the "chosen" reply is empty'),
        ({"prompt": "up", "chosen": "abcd", "rejected": "w" * 60}, 'pairs.jsonl:3: the prompt and its'),
        ("{not json", "pairs.jsonl:3: not a JSON object"),
    ],
)  # fmt: skip
def test_a_bad_pair_is_one_line_naming_it_and_leaves_no_run(
    setup: Path, tmp_path: Path, capsys, row, message: str
) -> None:
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [*preference_rows(2, 5), row, *preference_rows(20, 6)])
    args = dpo_args(setup, tmp_path / "run")
    args[3] = pairs
    code, _, err = run_cli(args, capsys)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def test_bad_grpo_inputs_are_one_line(setup: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "broken.py").write_text("def fn(prompt, reply, row):\n    return row['answer']\n")
    code, _, err = run_cli(
        grpo_args(setup, tmp_path / "run", "--reward", f"{tmp_path / 'broken.py'}:fn"), capsys
    )
    assert_one_line_error(code, err, "prompts.jsonl:")
    assert f"--reward {tmp_path / 'broken.py'}:fn: KeyError: 'answer'" in err
    assert not (tmp_path / "run").exists()
    code, _, err = run_cli(grpo_args(setup, tmp_path / "run", "--reward", "number"), capsys)
    assert_one_line_error(code, err, 'prompts.jsonl:1: --reward number needs an "answer" holding a number')
    args = grpo_args(setup, tmp_path / "run")
    del args[args.index("--reward") : args.index("--reward") + 2]
    code, _, err = run_cli(args, capsys)
    assert_one_line_error(code, err, "--task grpo needs --reward")
    code, _, err = run_cli(
        [
            "train",
            "--task",
            "sft",
            str(setup / "pairs.jsonl"),
            "--reward",
            "number",
            "--out",
            str(tmp_path / "x"),
        ],
        capsys,
    )
    assert_one_line_error(code, err, "--reward needs --task grpo")
    code, _, err = run_cli(
        ["train", "--task", "dpo", str(setup / "pairs.jsonl"), "--out", str(tmp_path / "x")], capsys
    )
    assert_one_line_error(code, err, "--task dpo tunes a model: give --init-from")
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "mnop " * 8}])
    args = grpo_args(setup, tmp_path / "run")
    args[3] = long
    code, _, err = run_cli(args, capsys)
    assert_one_line_error(code, err, "long.jsonl:1: the prompt is")
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


def test_bad_eval_preferences_inputs_are_one_line(setup: Path, tmp_path: Path, capsys) -> None:
    pairs = str(setup / "val.jsonl")
    code, _, err = run_cli(["eval", str(setup / "base"), "--reference", str(setup / "base")], capsys)
    assert_one_line_error(code, err, "--reference needs --preferences")
    make_run(tmp_path / "other", text="entirely different letters: qrstuv")
    code, _, err = run_cli(
        ["eval", str(setup / "base"), "--preferences", pairs, "--reference", str(tmp_path / "other")], capsys
    )
    assert_one_line_error(code, err, "has another tokenizer than the model")
    code, _, err = run_cli(
        ["eval", str(setup / "base"), "--preferences", str(tmp_path / "none.jsonl")], capsys
    )
    assert_one_line_error(code, err, "no such file")
    code, _, err = run_cli(dpo_args(setup, tmp_path / "dpo", "--max-steps", "2"), capsys)
    assert code == 0, err
    code, _, err = run_cli(["eval", str(tmp_path / "dpo")], capsys)
    assert_one_line_error(code, err, "this is a preference-tuned model: give text to score")


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(setup: Path, tmp_path: Path) -> None:
    """A real kill of a grpo run (SIGKILL at a random moment after a checkpoint), then
    ``--resume``: the same weights as a run never interrupted, its sampled replies included (the
    crash tests above cover dpo and the other references)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lmcli.cli.app", "lmcli.train.loop", "lmcli.train.display"])
    extra = ("--max-steps", "24", "--eval-interval", "4", "--eval-batches", "1", "--kl-coef", "0.05")
    # one thread: with two, processes forked from the forkserver differ in the 7th digit after a
    # resume (an in-process resume on two threads is exact: the crash tests above), not yet explained
    args = grpo_args(setup, tmp_path / "full", *extra, "--threads", "1")

    def run(argv: list[str]) -> Any:
        process = ctx.Process(target=main, args=(argv,))
        process.start()
        return process

    full = run(args)
    full.join(120)
    assert full.exitcode == 0
    killed_args = [tmp_path / "killed" if a == str(tmp_path / "full") else a for a in args]
    killed = run([str(a) for a in killed_args])
    kill_after_checkpoint(killed, tmp_path / "killed", 8)
    assert killed.exitcode == -signal.SIGKILL and 8 <= saved_step(tmp_path / "killed") < 24
    resumed = run(["train", "--resume", str(tmp_path / "killed"), "--threads", "1", "-q"])
    resumed.join(120)
    assert resumed.exitcode == 0
    a, b = saved_tensors(tmp_path / "full"), saved_tensors(tmp_path / "killed")
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
