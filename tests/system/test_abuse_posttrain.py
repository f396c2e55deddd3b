"""Issue 48, findings 4, 6-9 (docs/bad-inputs.md rows 500-): DPO and GRPO inputs a hostile user
gives: a huge reply, rewards a float32 cannot hold, pairs that teach nothing, rows that say two
things, GRPO's memory, and reward functions that end their process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, make_run, read_metrics, run_cli, run_measured, train_config

from lmcli.config.model import ModelConfig
from lmcli.data.preferences import PreferenceRows, PromptRows
from lmcli.errors import LmcliError
from lmcli.formats.sources import load_checkpoint
from lmcli.model.kv_cache import kv_bytes
from lmcli.text.tokenizer import Tokenizer
from lmcli.train import Reporter, train
from lmcli.train.preflight import estimate_memory

ALPHABET = "abcdwxyzmnop updown system user assistant "
FAST = ("--batch-size", "4", "--warmup-steps", "1", "--threads", "1", "-q")
MB = 1 << 20


def pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    word = lambda letters: "".join(rng.choice(letters) for _ in range(4))  # noqa: E731
    return [
        {"prompt": f"up {word('mnop')}", "chosen": word("abcd"), "rejected": word("wxyz")} for _ in range(n)
    ]


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model of context 256 (so a pre-flight that counted the whole context for a
    few short replies would show it) and prompts of 3 letters."""
    tmp = tmp_path_factory.mktemp("abuse-post")
    make_run(tmp / "base", text=ALPHABET * 3, block_size=256)
    rng = random.Random(2)
    write_jsonl(
        tmp / "prompts.jsonl", [{"prompt": "".join(rng.choice("mnop") for _ in range(3))} for _ in range(20)]
    )
    return tmp


def dpo_args(base: Path, rows: str, out: Path) -> list[str]:
    return ["train", "--task", "dpo", rows, "--init-from", str(base / "base"), "--out", str(out), *FAST]


def grpo_args(base: Path, reward: str, out: Path, *extra: str) -> list[str]:
    return [
        *("train", "--task", "grpo", str(base / "prompts.jsonl"), "--init-from", str(base / "base")),
        *("--reward", reward, "--out", str(out), "--group-size", "4", "--max-new-tokens", "4"),
        *("--eval-batches", "1", *FAST, *extra),
    ]


# ----------------------------------------------------------------------------- 4: a huge reply


def test_a_huge_dpo_reply_is_one_line_before_it_is_tokenized(base: Path, tmp_path: Path) -> None:
    """A 10 MB reply among normal pairs took 2.1 GB and 8.8 s (40 MB: a Rust allocation abort,
    exit 134, the run folder left holding only its lock) before its length was checked: it is
    refused by its characters now, at the cost of a row that is refused for anything else."""
    good = pairs(8, 0)
    missing = write_jsonl(
        tmp_path / "missing.jsonl", [*good[:3], {"prompt": "q", "chosen": "abcd"}, *good[3:]]
    )
    huge = {"prompt": "q", "chosen": "word " * 2_000_000, "rejected": "x"}
    crafted = write_jsonl(tmp_path / "huge.jsonl", [*good[:3], huge, *good[3:]])
    results = run_measured(
        [dpo_args(base, missing, tmp_path / "r1"), dpo_args(base, missing, tmp_path / "r2")]
        + [dpo_args(base, crafted, tmp_path / "r3")]
    )
    assert [r["code"] for r in results] == [2, 2, 2], [r["err"] for r in results]
    message = (
        'huge.jsonl:4: the prompt and its "chosen" reply are 10,000,001 characters, more than the context'
    )
    assert message in results[2]["err"] and len(results[2]["err"].strip().splitlines()) == 1
    refused, crafted_run = results[1], results[2]
    assert crafted_run["peak"] < refused["peak"] + 150 * MB, (crafted_run["peak"] / MB, refused["peak"] / MB)
    assert crafted_run["seconds"] < refused["seconds"] + 2
    assert not any((tmp_path / name).exists() for name in ("r1", "r2", "r3"))


# ----------------------------------------------------------------------------- 7: pairs and rows


def test_pairs_whose_replies_are_the_same_are_skipped_with_a_count(tmp_path: Path, capsys) -> None:
    """They trained silently at loss ln 2 with zero gradient; now skipped, counted in one warning."""
    rows = pairs(5, 1)
    rows[1]["rejected"] = rows[1]["chosen"]
    rows[3]["rejected"] = rows[3]["chosen"]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    tok = Tokenizer.train("char", iter([ALPHABET]))
    kept = PreferenceRows(path).pairs(tok, 64)
    assert [p.where for p in kept] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    err = capsys.readouterr().err
    assert err == (
        f"warning: {path}: skipped 2 pair(s) whose chosen and rejected replies are the same "
        f"(the first: {path}:2): they teach nothing\n"
    )


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["[1, 2]", *map(json.dumps, pairs(8, 3))], "pairs.jsonl:1: expected a JSON object, got list"),
        (
            [
                *map(json.dumps, pairs(2, 3)),
                json.dumps({**pairs(1, 4)[0], "messages": [{"role": "user", "content": "x"}]}),
            ],
            'pairs.jsonl:3: the row holds both "prompt" and "messages": give one',
        ),
    ],
)
def test_a_row_that_is_no_object_or_says_two_things_is_one_line(
    base: Path, tmp_path: Path, capsys, rows: list[str], message: str
) -> None:
    """A first row ``[1, 2]`` was read as the start of one JSON list ("Extra data: line 2"); a row
    with both a prompt and messages was taken without saying which."""
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    code, _, err = run_cli(dpo_args(base, path, tmp_path / "run"), capsys)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- 6: rewards and nan


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return 1e39", "--reward {file}:r: returned 1e+39, beyond what a float32 holds (3.403e+38)"),
        (
            "return 3e38 if 'a' in reply else -3e38",
            "the rewards of its replies (-3e+38 to 3e+38) overflow float32 when compared within their group",
        ),
    ],
)
def test_a_reward_a_float32_cannot_hold_is_one_line_naming_the_row(
    base: Path, tmp_path: Path, capsys, body: str, message: str
) -> None:
    """A reward of 1e39 (finite in float64, inf in float32) gave `loss became nan ... the last good
    checkpoint is out/last (try a lower --lr)`: no such folder, and not the learning rate."""
    file = tmp_path / "big.py"
    file.write_text(f"def r(prompt, reply, row):\n    {body}\n")
    code, _, err = run_cli(grpo_args(base, f"{file}:r", tmp_path / "run", "--max-steps", "2"), capsys)
    assert_one_line_error(code, err, "prompts.jsonl:")
    assert message.format(file=file) in err and "loss became" not in err
    assert not (tmp_path / "run").exists()


def test_a_nan_before_any_checkpoint_names_no_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """It named `RUN/last` as "the last good checkpoint" although none was written yet."""
    (tmp_path / "c.txt").write_text(ALPHABET * 20)
    cfg = train_config(
        corpus=(str(tmp_path / "c.txt"),), out=str(tmp_path / "run"), batch_size=4, max_steps=20,
        eval_interval=10, log_interval=2, eval_batches=1,
    )  # fmt: skip
    real_ce = torch.nn.functional.cross_entropy
    monkeypatch.setattr("lmcli.train.losses.F.cross_entropy", lambda *a, **k: real_ce(*a, **k) * float("nan"))
    model = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(LmcliError) as exc:
        train(model, cfg, reporter=Reporter(info=lambda m: None), progress=False)
    assert str(exc.value) == (
        "loss became nan at or before step 2: stopped; no checkpoint was written before it (a "
        "learning rate too high is the usual cause: try a lower --lr)"
    )
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- 8: GRPO's memory


def test_grpo_preflight_counts_what_its_short_replies_cost(base: Path, tmp_path: Path) -> None:
    """8 prompts x 8 replies of a few tokens on a model of context 256: the estimate is about
    what those 64 short sequences cost (it counted the whole context for each: attention scores
    of 256 x 256, a cache of 256 columns a row), and no less than their decoding cache."""
    seen: list = []

    class Stop(Exception):
        pass

    def capture(pre, facts) -> None:
        seen.append(pre)
        raise Stop

    reward = tmp_path / "r.py"
    reward.write_text("def r(prompt, reply, row):\n    return len(reply)\n")
    cfg = train_config(
        task="grpo", corpus=(str(base / "prompts.jsonl"),), init_from=str(base / "base"),
        reward=(f"{reward}:r",),
        group_size=8, max_new_tokens=6, batch_size=8, out=str(tmp_path / "run"),
    )  # fmt: skip
    loaded = load_checkpoint(base / "base" / "last")
    with pytest.raises(Stop):
        train(
            loaded.model.config,
            cfg,
            reporter=Reporter(info=lambda m: None, preflight=capture),
            progress=False,
        )
    c, params = loaded.model.config, loaded.model.num_parameters()
    prompts = PromptRows(str(base / "prompts.jsonl")).prompts(loaded.tokenizer, c.block_size)
    context, rows = max(len(p.ids) for p in prompts) + 6, 64  # a prompt and its longest reply
    short = estimate_memory(c, params, rows, False, params, context) + rows * (
        kv_bytes(c, context, 4) + 16 * c.padded_vocab_size
    )
    least = params * 4 + rows * kv_bytes(c, context, 4)  # the weights and the replies' cache
    assert least < seen[0].memory_bytes <= short, (least, seen[0].memory_bytes, short)


# ----------------------------------------------------------------------------- 9: a reward that exits


@pytest.mark.slow
@pytest.mark.parametrize(
    ("call", "said"), [("sys.exit(0)", "called sys.exit(0)"), ("os._exit(0)", "exit code 0")]
)
def test_a_reward_that_ends_its_process_is_one_line_and_the_run_resumes(
    base: Path, tmp_path: Path, call: str, said: str
) -> None:
    """A reward calling sys.exit(0) ended `train` with exit 0 and no message; os._exit(0) left a
    folder without a checkpoint and exit 0. The function runs in a process of its own now: the
    call that exits is one line naming the row, the run keeps its checkpoint and resumes."""
    reward = tmp_path / "exits.py"
    reward.write_text(
        "import os, sys\nCALLS = [0]\n"
        f"def r(prompt, reply, row):\n    CALLS[0] += 1\n    if CALLS[0] > 40:\n        {call}\n"
        "    return reply.count('a') / max(len(reply), 1)\n"
    )
    args = grpo_args(base, f"{reward}:r", tmp_path / "run", "--max-steps", "6", "--eval-interval", "1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "lmcli", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "prompts.jsonl:" in lines[0], done.stderr
    assert f"--reward {reward}:r: " in lines[0] and said in lines[0]
    assert (tmp_path / "run" / "last" / "meta.json").exists()
    reward.write_text("def r(prompt, reply, row):\n    return reply.count('a') / max(len(reply), 1)\n")
    resumed = subprocess.run(
        [sys.executable, "-m", "lmcli", "train", "--resume", str(tmp_path / "run"), "-q"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert max(r["step"] for r in read_metrics(tmp_path / "run")) == 6
