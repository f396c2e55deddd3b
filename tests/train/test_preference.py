"""Preference losses equal their formulas on hand-made log-probabilities; reply log-probs equal a
log-softmax read directly; preference rows render as SFT renders a conversation, the loss on the
final reply, and bad rows are one line naming them."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer, train_config

from lmcli.data.preferences import (
    PreferenceRows,
    PromptRows,
    last_reply,
    load_preference_data,
    load_prompt_data,
)
from lmcli.errors import LmcliError
from lmcli.text.chat_template import encode_conversation
from lmcli.train.post.preference import preference_loss, row_sums, token_logprobs

# Summed reply log-probs of three pairs: policy and reference, chosen and rejected.
PC, PR = [-4.0, -7.5, -3.0], [-6.0, -5.0, -3.0]
RC, RR = [-5.0, -6.0, -2.5], [-5.5, -6.5, -3.5]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_equals_its_formula(beta: float) -> None:
    out = preference_loss(_t(PC), _t(PR), _t(RC), _t(RR), loss="dpo", beta=beta)
    losses, margins = [], []
    for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True):
        h = (pc - rc) - (pr - rr)
        losses.append(-math.log(_sigmoid(beta * h)))
        margins.append(beta * (pc - rc) - beta * (pr - rr))
    assert out.loss.item() == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert out.chosen_reward.tolist() == pytest.approx(
        [beta * (pc - rc) for pc, rc in zip(PC, RC, strict=True)]
    )
    assert out.rejected_reward.tolist() == pytest.approx(
        [beta * (pr - rr) for pr, rr in zip(PR, RR, strict=True)]
    )
    assert out.margin.tolist() == pytest.approx(margins)
    assert out.accuracy.tolist() == [float(m > 0) for m in margins] == [1.0, 0.0, 0.0]
    logged = out.logged()
    assert logged["accuracy"] == pytest.approx(1 / 3) and logged["margin"] == pytest.approx(sum(margins) / 3)


def test_dpo_gradient_is_the_papers() -> None:
    """d loss / d log pi(y_w) = -beta sigmoid(-beta h) / B, and the opposite for y_l."""
    beta = 0.2
    pc, pr = _t(PC, grad=True), _t(PR, grad=True)
    preference_loss(pc, pr, _t(RC), _t(RR), loss="dpo", beta=beta).loss.backward()
    for i in range(3):
        h = (PC[i] - RC[i]) - (PR[i] - RR[i])
        expected = -beta * _sigmoid(-beta * h) / 3
        assert pc.grad[i].item() == pytest.approx(expected, rel=1e-12)
        assert pr.grad[i].item() == pytest.approx(-expected, rel=1e-12)


def test_ipo_equals_its_formula() -> None:
    beta = 0.25
    out = preference_loss(_t(PC), _t(PR), _t(RC), _t(RR), loss="ipo", beta=beta)
    expected = [
        ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2 for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True)
    ]
    assert out.loss.item() == pytest.approx(sum(expected) / 3, rel=1e-12)
    assert out.margin.tolist() == pytest.approx(
        [beta * ((pc - rc) - (pr - rr)) for pc, pr, rc, rr in zip(PC, PR, RC, RR, strict=True)]
    )


def test_simpo_averages_over_tokens_and_reads_no_reference() -> None:
    beta, gamma = 2.0, 0.5
    nc, nr = [4.0, 5.0, 2.0], [3.0, 5.0, 6.0]
    out = preference_loss(
        _t(PC),
        _t(PR),
        None,
        None,
        loss="simpo",
        beta=beta,
        gamma=gamma,
        chosen_tokens=_t(nc),
        rejected_tokens=_t(nr),
    )
    expected = [
        -math.log(_sigmoid(beta * pc / a - beta * pr / b - gamma))
        for pc, pr, a, b in zip(PC, PR, nc, nr, strict=True)
    ]
    assert out.loss.item() == pytest.approx(sum(expected) / 3, rel=1e-12)
    assert out.chosen_reward.tolist() == pytest.approx([beta * pc / a for pc, a in zip(PC, nc, strict=True)])


def test_a_reference_loss_without_a_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="reference"):
        preference_loss(_t(PC), _t(PR), None, None, loss="dpo")
    with pytest.raises(LmcliError, match="choose from"):
        preference_loss(_t(PC), _t(PR), _t(RC), _t(RR), loss="kto")


def test_reply_logprobs_equal_a_direct_log_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g)  # (N, V): 7 scored positions
    targets = torch.randint(0, 11, (7,), generator=g)
    rows = torch.tensor([0, 0, 2, 2, 2, 1, 0])
    per_token = token_logprobs(logits, targets)
    direct = torch.log_softmax(logits, dim=-1)[torch.arange(7), targets]
    torch.testing.assert_close(per_token, direct)
    sums = row_sums(per_token, rows, 4)
    torch.testing.assert_close(sums, torch.stack([direct[rows == r].sum() for r in range(4)]))
    assert sums[3].item() == 0.0


# ----------------------------------------------------------------------------- rows

TEXT = "the cat sat on the mat. who sat? be brief. yes no abc system user assistant 0123456789+="


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_last_reply_keeps_the_final_run() -> None:
    assert last_reply([False, True, True, False, True, True, False]) == [False] * 4 + [True, True, False]
    assert last_reply([True, False]) == [True, False]


def test_pairs_render_as_sft_with_the_loss_on_the_final_reply(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT)
    history = [
        {"role": "user", "content": "who sat?"},
        {"role": "assistant", "content": "the cat."},
        {"role": "user", "content": "be brief."},
    ]
    path = _write(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "who sat?", "chosen": "the cat.", "rejected": "no"},
            {"messages": history, "chosen": {"role": "assistant", "content": "yes"}, "rejected": "abc"},
        ],
    )
    first, second = PreferenceRows(str(path)).pairs(tok, 200)
    assert first.where == f"{path}:1" and second.where == f"{path}:2"
    chat = [{"role": "user", "content": "who sat?"}, {"role": "assistant", "content": "the cat."}]
    ids, scored = encode_conversation(chat, None, tok)
    assert first.chosen.ids == ids and first.chosen.scored == scored  # one reply: as SFT marks it
    ids, scored = encode_conversation([*history, {"role": "assistant", "content": "abc"}], None, tok)
    assert second.rejected.ids == ids
    assert sum(scored) > sum(second.rejected.scored) == len(tok.encode("abc")) + 1  # the last reply and <eos>
    assert tok.decode([t for t, s in zip(ids, second.rejected.scored, strict=True) if s]).startswith("abc")
    assert second.rejected.prefix == second.rejected.scored.index(True)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "who sat?", "chosen": "yes"}, 'no "rejected" reply'),
        ({"prompt": "who sat?", "chosen": " ", "rejected": "no"}, 'the "chosen" reply is empty'),
        (
            {"prompt": "who sat?", "chosen": "yes", "rejected": "no " * 40},
            'the prompt and its "rejected" reply are',
        ),
        (
            {"messages": [{"role": "assistant", "content": "x"}], "chosen": "y", "rejected": "n"},
            "last message",
        ),
        ({"chosen": "y", "rejected": "n"}, 'expected "prompt"'),
        ({"prompt": "q", "chosen": {"role": "user", "content": "y"}, "rejected": "n"}, "role 'user'"),
    ],
)
def test_bad_preference_rows_name_the_row(tmp_path: Path, row: dict, message: str) -> None:
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "who sat?", "chosen": "yes", "rejected": "no"}, row])
    with pytest.raises(LmcliError) as exc:
        PreferenceRows(str(path)).pairs(tiny_tokenizer(TEXT), 60)
    assert str(exc.value).startswith(f"{path}:2: ") and message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_prompts_end_where_the_reply_begins(tmp_path: Path) -> None:
    tok = tiny_tokenizer(TEXT)
    path = _write(
        tmp_path / "prompts.jsonl",
        [{"prompt": "1+2=", "answer": "3"}, {"messages": [{"role": "user", "content": "2+2="}], "answer": 4}],
    )
    first, second = PromptRows(str(path)).prompts(tok, 64)
    full, scored = encode_conversation(
        [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}], None, tok
    )
    assert first.ids == full[: scored.index(True)]  # the prompt is the conversation before the reply
    assert (first.text, second.text, second.row["answer"]) == ("1+2=", "2+2=", 4)
    with pytest.raises(LmcliError, match=rf"^{path}:1: the prompt is \d+ tokens: no room"):
        PromptRows(str(path)).prompts(tok, len(first.ids))

    def check(row: dict, where: str) -> None:
        if not isinstance(row["answer"], str):
            raise LmcliError(f"{where}: answer must be text")

    with pytest.raises(LmcliError, match=rf"^{path}:2: answer must be text$"):
        PromptRows(str(path)).prompts(tok, 64, check)


@pytest.mark.parametrize(
    ("task", "noun"),
    [(dict(task="dpo"), "preference pairs"), (dict(task="grpo", reward=("number",)), "prompts")],
)
def test_rows_from_two_files_are_refused_in_one_line(task: dict, noun: str) -> None:
    cfg = train_config(corpus=("a.jsonl", "b.jsonl"), init_from="m", **task)
    load = load_preference_data if task["task"] == "dpo" else partial(load_prompt_data, check=None)
    with pytest.raises(LmcliError) as exc:
        load(cfg, 64, tiny_tokenizer(TEXT))
    assert (
        str(exc.value)
        == f"--task {task['task']} needs one file of {noun} (JSONL, JSON or parquet) or --dataset"
    )
