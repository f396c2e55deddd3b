"""`lmcli eval --task` end to end, its one-line errors, and `--eval-task` during training: a model
trained on the tiny corpus answers questions about it better than chance and than its untrained
self, every validation records the scores, and `--select` can follow one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TINY_TEXT, assert_one_line_error, read_metrics, run_cli, train_config

from lmcli.config.files import replace_options
from lmcli.errors import LmcliError
from lmcli.eval.downstream.evaluate import evaluate_tasks, load_tasks
from lmcli.formats.checkpoint import read_json
from lmcli.formats.sources import load_checkpoint
from lmcli.model.transformer import Transformer
from lmcli.train.state import seed_everything

ENDINGS = ["mat.", "log.", "tree.", "hill."]
# questions about the tiny corpus's four sentences: which ending follows each beginning
QUESTIONS = [
    ("the cat sat on the", ENDINGS, 0),
    ("the dog sat on the", ENDINGS, 1),
    ("a bird sang in the", ENDINGS, 2),
    ("the sun rose over the", ENDINGS, 3),
    ("the cat sat on", ["the mat.", "the log.", "the tree.", "the hill."], 0),
    ("the dog sat", ["on the log.", "on the mat.", "in the tree.", "over the hill."], 0),
    ("a bird", ["sang in the tree.", "sat on the mat.", "sat on the log.", "rose over the hill."], 0),
    ("the sun", ["sat on the log.", "rose over the hill.", "sang in the tree.", "sat on the mat."], 1),
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def mc(tmp_path: Path) -> Path:
    rows = [{"context": c, "choices": ch, "answer": a} for c, ch, a in QUESTIONS]
    return write_jsonl(tmp_path / "mc.jsonl", rows)


def test_eval_task_table_and_json(tiny_run: Path, mc: Path, tmp_path: Path, capsys) -> None:
    cloze = write_jsonl(
        tmp_path / "lambada.jsonl", [{"text": "the cat sat on the mat"}, {"text": "a bird sang"}]
    )
    gen = write_jsonl(
        tmp_path / "gen.jsonl",
        [
            {"context": "the cat sat on the", "answer": "mat.", "fewshot": True},
            {"context": "the dog", "answer": "sat"},
        ],
    )
    argv = ["eval", str(tiny_run), "--task", str(mc), "--task", str(cloze), "--task", str(gen)]
    code, out, err = run_cli([*argv, "--num-fewshot", "1", "--limit", "3", "--max-gen-tokens", "4"], capsys)
    assert code == 0, err
    assert all(name in out for name in ("mc", "lambada", "gen", "acc_norm *", "perplexity", "exact_match *"))
    assert "combined score (mean of the scores marked *)" in out
    code, out, err = run_cli([*argv, "--limit", "3", "--max-gen-tokens", "4", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and set(report["tasks"]) == {"mc", "lambada", "gen"} and report["harness"] == {}
    assert report["tasks"]["mc"]["rows"] == 3 and report["tasks"]["lambada"]["rows"] == 2
    assert report["tasks"]["gen"] == {"kind": "generation", "rows": 1, "fewshot": 0, "exact_match": 0.0}
    mains = [report["tasks"]["mc"]["acc_norm"], report["tasks"]["lambada"]["acc"], 0.0]
    assert report["combined"] == pytest.approx(sum(mains) / 3)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"context": "x", "choices": ["a", "b"]', "bad.jsonl:2: not a JSON object"),
        ({"context": "x", "choices": ["a", "b"], "answer": 2}, "bad.jsonl:2: answer 2 is out of range"),
        (
            {"context": "x", "choices": [], "answer": 0},
            "bad.jsonl:2: choices must be a non-empty list of texts",
        ),
    ],
)
def test_bad_task_rows_are_one_line(tiny_run: Path, tmp_path: Path, row, message: str, capsys) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"context": "x", "choices": ["a", "b"], "answer": 0}, row])
    code, _, err = run_cli(["eval", str(tiny_run), "--task", str(bad)], capsys)
    assert_one_line_error(code, err, message)


def test_task_files_and_text_do_not_mix(tiny_run: Path, mc: Path, capsys) -> None:
    code, _, err = run_cli(["eval", str(tiny_run), str(mc), "--task", str(mc)], capsys)
    assert_one_line_error(code, err, "--task and --harness score task files: give no text to evaluate")
    code, _, err = run_cli(["eval", str(tiny_run), "--task", str(mc.with_name("none.jsonl"))], capsys)
    assert_one_line_error(code, err, "none.jsonl: No such file or directory")


def test_select_must_name_a_given_task() -> None:
    with pytest.raises(LmcliError, match="--select task:hs:acc: no --eval-task is named hs"):
        train_config(eval_task=["mc.jsonl"], select="task:hs:acc")
    with pytest.raises(LmcliError, match="best/ follows a score that grows"):
        train_config(eval_task=["mc.jsonl"], select="task:mc:perplexity")
    assert (
        train_config(eval_task=["mc.jsonl"], select="task:mc:acc_norm").selected_metric == "task:mc:acc_norm"
    )


def test_select_of_a_score_the_task_has_not(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(TINY_TEXT)
    cloze = write_jsonl(tmp_path / "cl.jsonl", [{"context": "the cat sat on the", "target": " mat"}])
    argv = [
        "train",
        str(corpus),
        "-o",
        str(tmp_path / "run"),
        "--eval-task",
        str(cloze),
        "--select",
        "task:cl:acc_norm",
    ]
    code, _, err = run_cli([*argv, "--max-steps", "2", "-q"], capsys)
    assert_one_line_error(code, err, "--select task:cl:acc_norm: cl is a cloze task: choose acc")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_training_scores_tasks_at_each_validation(tmp_path: Path, mc: Path, capsys) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(TINY_TEXT)
    run = tmp_path / "run"
    shape = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]
    schedule = ["--batch-size", "8", "--max-steps", "100", "--eval-interval", "50", "--eval-batches", "1"]
    argv = ["train", str(corpus), "-o", str(run), *shape, *schedule, "--warmup-steps", "5", "--lr", "3e-3"]
    code, _, err = run_cli([*argv, "--eval-task", str(mc), "--select", "task:mc:acc_norm", "-q"], capsys)
    assert code == 0, err
    scored = [r for r in read_metrics(run) if "val_loss" in r]
    assert [r["step"] for r in scored] == [50, 100]
    assert all({"task:mc:acc", "task:mc:acc_norm"} <= set(r) for r in scored)
    assert (run / "tasks.png").stat().st_size > 1000  # the scores plotted beside loss.png
    best = max(scored, key=lambda r: (r["task:mc:acc_norm"], -r["val_loss"]))
    assert read_json(run / "best" / "meta.json", "meta")["step"] == best["step"]

    trained = load_checkpoint(run / "best")
    seed_everything(trained.train_config.seed)  # the weights training started from
    untrained = Transformer(trained.model_config).eval()
    tasks = load_tasks((str(mc),))
    [after] = evaluate_tasks(trained.model, trained.tokenizer, tasks)
    [before] = evaluate_tasks(untrained, trained.tokenizer, tasks)
    assert after.scores["acc_norm"] == best["task:mc:acc_norm"]
    assert after.scores["acc_norm"] > 0.25 + 0.2 and after.scores["acc_norm"] > before.scores["acc_norm"]
    assert replace_options(trained.train_config, select=None).validation.eval_task == (str(mc),)
