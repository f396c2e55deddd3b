"""Task files: lmcli's rows, the published layouts read as lm-evaluation-harness reads them,
few-shot rows, limits, and a one-line error for every bad row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcli.errors import LmcliError
from lmcli.eval.downstream.formats import Item, read_task


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


MC = {"context": "the cat sat on the", "choices": ["mat.", "log."], "answer": 0}


def test_lmcli_rows_of_each_kind(tmp_path: Path) -> None:
    mc = read_task(write(tmp_path / "mc.jsonl", [MC, {**MC, "answer": 1}]))
    assert (mc.name, mc.kind, len(mc.items)) == ("mc", "multiple_choice", 2)
    assert mc.items[1] == Item("the cat sat on the", ("mat.", "log."), 1)
    cloze = read_task(write(tmp_path / "c.jsonl", [{"context": "the cat sat on the", "target": " mat"}]))
    assert cloze.kind == "cloze" and cloze.items[0].target == " mat"
    gen = read_task(write(tmp_path / "g.jsonl", [{"context": "Q: 2+2\nA:", "answer": "4", "stop": ["\n"]}]))
    assert gen.kind == "generation" and gen.items[0].stop == ("\n",)


def test_published_layouts(tmp_path: Path) -> None:
    hellaswag = {
        "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he",
        "endings": ["is using wrap to wrap a pair of skis.", "starts pulling up roofing [title] on a roof."],
        "label": "1",
    }
    [item] = read_task(write(tmp_path / "hs.jsonl", [hellaswag])).items
    assert item.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert item.choices == ("is using wrap to wrap a pair of skis.", "starts pulling up roofing. on a roof.")
    assert item.answer == 1
    arc_hf = {
        "question": "Which is a gas?",
        "choices": {"text": ["ice", "steam"], "label": ["A", "B"]},
        "answerKey": "B",
    }
    arc_orig = {
        "question": {
            "stem": "Which is a gas?",
            "choices": [{"text": "ice", "label": "1"}, {"text": "steam", "label": "2"}],
        },
        "answerKey": "2",
    }
    for row in (arc_hf, arc_orig):
        [item] = read_task(write(tmp_path / "arc.jsonl", [row])).items
        assert item == Item("Question: Which is a gas?\nAnswer:", ("ice", "steam"), 1)
    [item] = read_task(write(tmp_path / "lambada.jsonl", [{"text": "she looked at the old dog"}])).items
    assert (item.context, item.target) == ("she looked at the old", " dog")
    gsm = {"question": "Tom has 3 apples and eats one. How many are left?", "answer": "3 - 1 = 2\n#### 2"}
    task = read_task(write(tmp_path / "gsm8k.jsonl", [gsm]))
    assert task.kind == "generation" and task.items[0].target == "2" and task.items[0].shown == gsm["answer"]


def test_fewshot_rows_and_limit(tmp_path: Path) -> None:
    rows = [{**MC, "context": f"q{i}"} for i in range(6)]
    plain = write(tmp_path / "plain.jsonl", rows)
    task = read_task(plain, limit=2, num_fewshot=3)  # no row marked: the first 3 are the examples
    assert [s.context for s in task.shots] == ["q0", "q1", "q2"]
    assert [i.context for i in task.items] == ["q3", "q4"]
    marked = write(tmp_path / "marked.jsonl", [{**rows[5], "fewshot": True}, *rows[:5]])
    task = read_task(marked, num_fewshot=1)
    assert [s.context for s in task.shots] == ["q5"] and len(task.items) == 5
    assert read_task(marked).shots == []  # fewshot rows are never scored
    with pytest.raises(LmcliError, match="--num-fewshot 6 needs 6 solved example"):
        read_task(plain, num_fewshot=6)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["{not json"], "bad.jsonl:1: not a JSON object"),
        (
            [MC, {"context": "x", "choices": ["a"], "answer": 3}],
            "bad.jsonl:2: answer 3 is out of range: 1 choice(s), 0 to 0",
        ),
        ([{"context": "x", "choices": [], "answer": 0}], "choices must be a non-empty list"),
        ([{"context": "x", "choices": ["a", ""], "answer": 0}], "choice 1 must be a non-empty text"),
        (
            [{"context": "x", "choices": ["a", "b"], "answer": "a"}],
            "answer must be the index of the right choice",
        ),
        (
            [{"context": "x", "label": 1}],
            'expected "context" with "choices" and "answer", "target", or "answer" (found: context, label)',
        ),
        ([{"question": "x"}], "bad.jsonl:1: context must be text"),
        ([MC, {"context": "x", "target": " y"}], "bad.jsonl:2: a cloze row in a multiple_choice file"),
        ([{"context": "x", "answer": "1", "extract": "("}], "extract is not a regular expression"),
        ([{"ctx_a": "a", "ctx_b": "b", "endings": ["c"], "label": ""}], "a HellaSwag row without a label"),
        (
            [{"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "C"}],
            "answerKey 'C' is not one of",
        ),
        ([""], "bad.jsonl: no rows to score"),
    ],
)
def test_bad_rows_are_one_line_naming_the_line(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(LmcliError) as info:
        read_task(write(tmp_path / "bad.jsonl", rows))
    assert message in str(info.value) and "\n" not in str(info.value)
