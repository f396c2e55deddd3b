"""`lmcli train --task sft`: a tiny model learns a synthetic instruction task from chat rows and
answers held-out prompts exactly; bad rows and templates are one-line errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, read_metrics, run_cli, train_config

from lmcli.formats.sources import load_checkpoint
from lmcli.text import chat_template

LETTERS = "abcdefgh"
# two instructions on five-letter words: copy it, or shift every letter to the next one (h -> a)
TASKS = {
    "cpy": lambda w: w,
    "nxt": lambda w: "".join(LETTERS[(LETTERS.index(c) + 1) % len(LETTERS)] for c in w),
}


def words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(LETTERS) for _ in range(5)) for _ in range(n)]


def prompts(ws: list[str]) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: "cpy WORD" and "nxt WORD" alternating."""
    names = [*TASKS] * len(ws)
    return [(f"{name} {w}", TASKS[name](w)) for w, name in zip(ws, names[: len(ws)], strict=True)]


def instruction_rows(ws: list[str]) -> list[dict]:
    """The instruction set, half as prompt/response rows, half as chat messages."""
    rows: list[dict] = []
    for i, (prompt, answer) in enumerate(prompts(ws)):
        if i % 4 < 2:
            rows.append({"prompt": prompt, "response": answer})
        else:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            rows.append({"messages": turns})
    return rows


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def reply(run: Path, prompt: str) -> str:
    """The greedy reply to one user message, prompted as `lmcli serve` prompts."""
    ckpt = load_checkpoint(run)
    tok, model = ckpt.tokenizer, ckpt.model
    ids = chat_template.encode([{"role": "user", "content": prompt}], tok.chat_template, tok)
    start = len(ids)
    with torch.no_grad():
        while len(ids) < start + 10:
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            if nxt == tok.eos_id:
                break
            ids.append(nxt)
    return tok.decode(ids[start:])


@pytest.mark.slow
def test_a_tiny_model_fine_tuned_with_sft_answers_held_out_prompts(tmp_path: Path, capsys) -> None:
    train_words = words(1500, 0)
    data = write_jsonl(tmp_path / "train.jsonl", instruction_rows(train_words))
    code, _, err = run_cli(
        [
            *(
                "train",
                "--task",
                "sft",
                data,
                "-o",
                str(tmp_path / "run"),
                "--cache-dir",
                str(tmp_path / "c"),
            ),
            *("--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32"),
            *("--batch-size", "64", "--lr", "3e-3", "--warmup-steps", "20", "--max-steps", "350"),
            *("--eval-interval", "175", "--eval-batches", "2", "--val-fraction", "0.05", "-q"),
        ],
        capsys,
    )
    assert code == 0, err
    held_out = [w for w in dict.fromkeys(words(60, 99)) if w not in set(train_words)][:40]
    assert len(held_out) == 40
    right = sum(reply(tmp_path / "run", prompt) == answer for prompt, answer in prompts(held_out))
    assert right >= 0.9 * len(held_out), f"{right}/{len(held_out)}"
    # `lmcli eval` of an SFT run scores its validation replies as training's validation did
    best = min(r["val_loss"] for r in read_metrics(tmp_path / "run") if "val_loss" in r)
    code, out, err = run_cli(["eval", str(tmp_path / "run"), "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert "reply tokens only" in report["evaluated"]
    assert report["nll_per_token"] == pytest.approx(best, abs=1e-4)
    assert report["tokens"] == 75 * 6  # 5% of 1500 rows, five letters and <eos> each: no prompt token


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"prompt": "cpy ab", "response": "ab"}, {"prompt": "cpy cd"}],
            'train.jsonl:2: expected "prompt" and "response"',
        ),
        (
            [{"messages": [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "cpy ab"}]}],
            "train.jsonl:1: roles out of order",
        ),
        (
            [{"messages": [{"role": "user", "content": "cpy ab"}, {"role": "assistant", "content": ""}]}],
            "empty assistant turn",
        ),
    ],
)
def test_bad_rows_are_one_line_errors(tmp_path: Path, capsys, rows: list, message: str) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    code, _, err = run_cli(["train", "--task", "sft", data, "-o", str(tmp_path / "run"), "-q"], capsys)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "run").exists()


def test_a_template_that_fails_to_render_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer("cpy nxt abcdefgh system user assistant")
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system message') }}{% endif %}"
    )
    tok.save(tmp_path / "tokenizer.json")
    data = write_jsonl(tmp_path / "train.jsonl", instruction_rows(words(20, 0)))
    code, _, err = run_cli(
        [
            "train",
            "--task",
            "sft",
            data,
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "-o",
            str(tmp_path / "r"),
            "-q",
        ],
        capsys,
    )
    assert_one_line_error(code, err, "chat template: needs a system message")


def test_sft_from_an_lmcli_run_takes_its_weights_tokenizer_and_template(tmp_path: Path, capsys) -> None:
    from helpers import tiny_model, tiny_tokenizer

    from lmcli.formats.checkpoint import save_checkpoint

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    base = tiny_model(tok.vocab_size, block_size=32)
    save_checkpoint(tmp_path / "base" / "last", base, train_config(), tok, meta={"step": 0})
    rows = [{"prompt": "the cat", "response": "sat on the mat."}] * 20
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    code, _, err = run_cli(
        [
            *(
                "train",
                "--task",
                "sft",
                data,
                "--init-from",
                str(tmp_path / "base"),
                "-o",
                str(tmp_path / "run"),
            ),
            *(
                "--max-steps",
                "2",
                "--batch-size",
                "4",
                "--eval-interval",
                "2",
                "--cache-dir",
                str(tmp_path / "c"),
                "-q",
            ),
        ],
        capsys,
    )
    assert code == 0, err
    tuned = load_checkpoint(tmp_path / "run")
    assert (
        tuned.tokenizer.fingerprint == tok.fingerprint and tuned.tokenizer.chat_template == tok.chat_template
    )
    assert tuned.model_config == base.config
    # the examples were rendered with the run's template: the prompt, <eos>, the reply, <eos>
    data_cache = list((tmp_path / "c").glob("examples-*.bin"))
    assert len(data_cache) == 1
    ids = [*tok.encode("the cat"), tok.eos_id, *tok.encode("sat on the mat."), tok.eos_id]
    assert np.fromfile(data_cache[0], dtype=np.uint16)[: len(ids)].tolist() == ids
