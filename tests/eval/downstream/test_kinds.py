"""How each kind turns log-likelihoods and generations into scores: lm-evaluation-harness's
definitions (acc_norm by the choice's characters, ties to the first choice, cloze perplexity
over rows, exact match after extraction), and its few-shot prompt layout."""

from __future__ import annotations

import math

import pytest
from helpers import tiny_model, tiny_tokenizer

from lmcli.eval.downstream import kinds
from lmcli.eval.downstream.formats import GSM8K_ANSWER, Item
from lmcli.eval.downstream.kinds import KIND_OF, Scorer
from lmcli.generate.sampling import Generated


@pytest.fixture
def scorer() -> Scorer:
    tok = tiny_tokenizer()
    return Scorer(tiny_model(tok.vocab_size), tok)


def fake_scores(monkeypatch: pytest.MonkeyPatch, lls: list[list[float]]) -> None:
    monkeypatch.setattr(
        kinds, "score_groups", lambda model, groups, *a: [[(ll, False) for ll in g] for g in lls]
    )


def test_acc_sums_and_acc_norm_divides_by_the_choice_characters(monkeypatch, scorer: Scorer) -> None:
    items = [
        Item("q", ("a", "bbbb"), 1),  # -2 vs -4: acc picks "a"; per character -2 vs -1: acc_norm "bbbb"
        Item("q", ("ab", "cd", "ef"), 0),  # a tie: the first choice, as numpy.argmax
        Item("q", ("é", "ee"), 0),  # per character -1 vs -0.75: "ee" (per byte -0.5 would keep "é")
    ]
    fake_scores(monkeypatch, [[-2.0, -4.0], [-3.0, -3.0, -5.0], [-1.0, -1.5]])
    rows = KIND_OF["multiple_choice"].score(scorer, items, [])
    assert rows == [
        {"acc": 0.0, "acc_norm": 1.0},
        {"acc": 1.0, "acc_norm": 1.0},
        {"acc": 1.0, "acc_norm": 0.0},
    ]
    assert KIND_OF["multiple_choice"].aggregate(rows) == {"acc": 2 / 3, "acc_norm": 2 / 3}


def test_cloze_perplexity_is_over_rows(monkeypatch, scorer: Scorer) -> None:
    monkeypatch.setattr(kinds, "score_groups", lambda *a: [[(-1.0, True)], [(-3.0, False)]])
    rows = KIND_OF["cloze"].score(scorer, [Item("a", target=" b"), Item("c", target=" d")], [])
    assert KIND_OF["cloze"].aggregate(rows) == {"acc": 0.5, "perplexity": pytest.approx(math.exp(2.0))}


def test_generation_exact_match_after_extraction(monkeypatch, scorer: Scorer) -> None:
    answers = ["so 1,000 apples.\n#### 1,000", "#### 7", "it is 4"]
    monkeypatch.setattr(
        kinds,
        "generate",
        lambda m, t, prompts, cfg: [Generated(i, 0, text=answers[i]) for i in range(len(prompts))],
    )
    gsm = dict(extract=GSM8K_ANSWER)
    items = [Item("q1", target="1000", **gsm), Item("q2", target="8", **gsm), Item("q3", target=" it is 4 ")]
    rows = KIND_OF["generation"].score(scorer, items, [])
    assert [r["exact_match"] for r in rows] == [1.0, 0.0, 1.0]


def test_fewshot_prompt_layout() -> None:
    shots = [Item("Q: 1+1\nA:", ("2", "3"), 0), Item("Q: 2+2\nA:", ("4", "5"), 0)]
    item = Item("Q: 3+3\nA:", ("6", "7"), 0)
    assert KIND_OF["multiple_choice"].prompt(item, shots) == "Q: 1+1\nA: 2\n\nQ: 2+2\nA: 4\n\nQ: 3+3\nA:"
    cloze = [Item("the cat sat on the", target=" mat")]
    assert KIND_OF["cloze"].prompt(Item("a dog", target=" x"), cloze) == "the cat sat on the mat\n\na dog"
