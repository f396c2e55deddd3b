"""Downstream task files: JSONL rows in lmcli's format or a published layout, read and checked.

lmcli's format, one JSON object per line (docs/evaluation.md), the kind told by its keys:

- multiple choice: ``{"context": "...", "choices": ["...", ...], "answer": 0}``;
- cloze: ``{"context": "...", "target": " word"}`` (the target follows the context exactly);
- generation: ``{"context": "...", "answer": "72"}``, optionally ``"solution"`` (what a few-shot
  example shows as its answer), ``"extract"`` (a regular expression whose first group is the
  prediction) and ``"stop"`` (strings that end the generation).

Any row may carry ``"fewshot": true``: it is a solved example for ``--num-fewshot``, not scored.
The published layouts are converted to it, as lm-evaluation-harness reads them: HellaSwag
(``ctx_a``, ``ctx_b``, ``endings``, ``label``), ARC (``question``, ``choices``, ``answerKey``;
the original files' nested ``question.stem`` too), LAMBADA (``text``: its last word is the
target) and GSM8K (``question``, ``answer`` with ``#### N``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcli.config.fields import task_name
from lmcli.data.corpus import read_lines
from lmcli.errors import LmcliError
from lmcli.safe_io import check_text, parse_json

KINDS = ("multiple_choice", "cloze", "generation")
MAX_CHOICES = 1024  # choices of one row (benchmarks have 2 to 10; each is a forward's row)
GSM8K_ANSWER = r"#### (\-?[0-9\.\,]+)"  # lm-evaluation-harness gsm8k's strict-match


@dataclass(frozen=True)
class Item:
    """One row: its context and, by kind, its choices and answer index (multiple choice), its
    target (cloze) or its answer (generation)."""

    context: str
    choices: tuple[str, ...] = ()
    answer: int = 0  # multiple choice: the index of the right choice
    target: str = ""  # cloze: the text that follows the context; generation: the answer
    solution: str | None = None  # generation: a few-shot example's answer as shown
    extract: str | None = None  # generation: a regex whose first group is the prediction
    stop: tuple[str, ...] = ()  # generation: extra stop strings

    @property
    def shown(self) -> str:
        """The answer as a few-shot example shows it after the context."""
        if self.choices:
            return self.choices[self.answer]
        return self.solution if self.solution is not None else self.target


@dataclass
class TaskFile:
    """A task file read: its name, kind, the rows to score and the few-shot examples."""

    name: str
    path: str
    kind: str
    items: list[Item] = field(default_factory=list)
    shots: list[Item] = field(default_factory=list)


def read_task(path: str | Path, limit: int | None = None, num_fewshot: int = 0) -> TaskFile:
    """The task in ``path``: its first ``limit`` rows to score and ``num_fewshot`` solved examples
    (its ``"fewshot": true`` rows; a file without any gives its first rows, then not scored).
    Every row is checked: a bad one is a one-line error naming FILE:LINE."""
    task = TaskFile(task_name(path), str(path), "")
    marked: list[Item] = []
    for number, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        row = parse_json(line, where)
        kind, item, fewshot = parse_row(to_lmcli(row, where), where)
        if task.kind and kind != task.kind:
            raise LmcliError(f"{where}: a {kind} row in a {task.kind} file: one kind per file")
        task.kind = kind
        (marked if fewshot else task.items).append(item)
    if not task.items:
        raise LmcliError(f"{path}: no rows to score")
    pool = marked or task.items
    if len(pool) < num_fewshot or len(task.items) <= (0 if marked else num_fewshot):
        raise LmcliError(
            f"{path}: --num-fewshot {num_fewshot} needs {num_fewshot} solved example(s) and a row to "
            f"score; the file has {len(task.items)} row(s) to score and {len(marked)} fewshot row(s)"
        )
    task.shots = pool[:num_fewshot]
    scored = task.items if marked else task.items[num_fewshot:]
    task.items = scored[:limit] if limit is not None else scored
    return task


def parse_row(row: dict[str, Any], where: str) -> tuple[str, Item, bool]:
    """(kind, item, is a few-shot example) of a row in lmcli's format, checked."""
    context = _text(row, "context", where)
    fewshot = row.get("fewshot", False)
    if not isinstance(fewshot, bool):
        raise LmcliError(f"{where}: fewshot must be true or false")
    if "choices" in row:
        choices = _choices(row["choices"], where)
        answer = row.get("answer")
        if not isinstance(answer, int) or isinstance(answer, bool):
            raise LmcliError(f"{where}: answer must be the index of the right choice, got {answer!r}")
        if not 0 <= answer < len(choices):
            raise LmcliError(
                f"{where}: answer {answer} is out of range: {len(choices)} choice(s), 0 to {len(choices) - 1}"
            )
        return "multiple_choice", Item(context, tuple(choices), answer), fewshot
    if "target" in row:
        target = _text(row, "target", where)
        if not target.strip():
            raise LmcliError(f"{where}: target is empty")
        return "cloze", Item(context, target=target), fewshot
    if "answer" in row:
        answer_text = _text(row, "answer", where)
        solution = _text(row, "solution", where) if "solution" in row else None
        extract = row.get("extract")
        if extract is not None:
            _check_regex(extract, where)
        stop = row.get("stop", [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise LmcliError(f"{where}: stop must be a list of non-empty texts")
        for i, text in enumerate(stop):
            check_text(text, f"{where}: stop {i}")
        return (
            "generation",
            Item(context, target=answer_text, solution=solution, extract=extract, stop=tuple(stop)),
            fewshot,
        )
    found = ", ".join(sorted(row)) or "nothing"
    raise LmcliError(
        f'{where}: expected "context" with "choices" and "answer", "target", or "answer" (found: {found})'
    )


def _choices(choices: Any, where: str) -> list[str]:
    """A row's choices: a list of at most ``MAX_CHOICES`` non-empty texts."""
    if not isinstance(choices, list) or not choices:
        raise LmcliError(f"{where}: choices must be a non-empty list of texts")
    if len(choices) > MAX_CHOICES:
        raise LmcliError(f"{where}: {len(choices):,} choices (a row has at most {MAX_CHOICES:,})")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise LmcliError(f"{where}: choice {i} must be a non-empty text, got {choice!r:.60}")
        check_text(choice, f"{where}: choice {i}")
    return choices


def _text(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise LmcliError(f"{where}: {key} must be text, got {value!r:.60}")
    return check_text(value, f"{where}: {key}")


def _check_regex(pattern: Any, where: str) -> None:
    try:
        compiled = re.compile(pattern) if isinstance(pattern, str) else None
    except re.error as exc:
        raise LmcliError(f"{where}: extract is not a regular expression: {exc}") from None
    if compiled is None or compiled.groups < 1:
        raise LmcliError(f"{where}: extract must be a regular expression with a group (the prediction)")


# ----------------------------------------------------------------------------- published layouts


def to_lmcli(row: Any, where: str) -> dict[str, Any]:
    """A row of a published layout as a row of lmcli's format; lmcli's rows unchanged."""
    if not isinstance(row, dict):
        raise LmcliError(f"{where}: not a JSON object")
    if "context" in row:
        return row
    if "endings" in row and "ctx_a" in row:
        return _hellaswag(row, where)
    if "answerKey" in row:
        return _arc(row, where)
    if isinstance(row.get("question"), str) and isinstance(row.get("answer"), str):
        return _gsm8k(row, where)
    if set(row) == {"text"} or ("text" in row and "domain" in row):
        return _lambada(row, where)
    return row  # parse_row names what is missing


def _hellaswag_clean(text: str) -> str:
    """lm-evaluation-harness hellaswag's ``preprocess``: WikiHow's bracketed artifacts removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict[str, Any], where: str) -> dict[str, Any]:
    if row.get("label") in (None, ""):
        raise LmcliError(
            f"{where}: a HellaSwag row without a label (the test split has none: use the val file)"
        )
    try:
        context = row.get("activity_label", "") + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize()
        endings = [_hellaswag_clean(e) for e in row["endings"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise LmcliError(f"{where}: not a HellaSwag row ({type(exc).__name__}: {exc})") from None
    label = row["label"]
    number = int(label) if type(label) is int or (isinstance(label, str) and label.isdecimal()) else None
    if number is None or not 0 <= number < len(endings):
        raise LmcliError(
            f"{where}: HellaSwag label {label!r} is not the index of one of its {len(endings)} endings "
            f"(0 to {len(endings) - 1})"
        )
    return {"context": _hellaswag_clean(context), "choices": endings, "answer": number}


def _arc(row: dict[str, Any], where: str) -> dict[str, Any]:
    question, choices = row.get("question"), row.get("choices")
    if isinstance(question, dict):  # the original files: {"stem": ..., "choices": [{"text", "label"}]}
        question, choices = question.get("stem"), question.get("choices")
        choices = {
            "text": [c.get("text") for c in choices or []],
            "label": [c.get("label") for c in choices or []],
        }
    if not isinstance(question, str) or not isinstance(choices, dict):
        raise LmcliError(f"{where}: not an ARC row (question and choices with text and label)")
    labels, texts = choices.get("label") or [], choices.get("text") or []
    if not isinstance(labels, list) or not isinstance(texts, list) or len(labels) != len(texts):
        count = [len(v) if isinstance(v, list) else "no list of" for v in (texts, labels)]
        raise LmcliError(
            f"{where}: an ARC row with {count[0]} choice texts and {count[1]} labels: one label a text"
        )
    if len(set(map(str, labels))) != len(labels):
        raise LmcliError(f"{where}: an ARC row whose labels repeat ({labels})")
    if row["answerKey"] not in labels:
        raise LmcliError(f"{where}: answerKey {row['answerKey']!r} is not one of the labels {labels}")
    return {
        "context": f"Question: {question}\nAnswer:",
        "choices": texts,
        "answer": labels.index(row["answerKey"]),
    }


def _lambada(row: dict[str, Any], where: str) -> dict[str, Any]:
    words = _text(row, "text", where).split(" ")
    if len(words) < 2:
        raise LmcliError(f"{where}: a LAMBADA text needs at least two words")
    return {"context": " ".join(words[:-1]), "target": " " + words[-1]}


def _gsm8k(row: dict[str, Any], where: str) -> dict[str, Any]:
    found = re.search(GSM8K_ANSWER, row["answer"])
    if found is None:
        raise LmcliError(f"{where}: a GSM8K answer without '#### N'")
    return {
        "context": f"Question: {row['question']}\nAnswer:",
        "answer": found.group(1),
        "solution": row["answer"],
        "extract": GSM8K_ANSWER,
        "stop": ["Question:"],
    }
