"""lmcli against EleutherAI's lm-evaluation-harness on the same folders and local tasks (YAML +
JSONL made here, found with --include_path): the built-in scorer and the ``lmcli`` backend inside
the harness give the harness's own ``hf`` backend's answers, question by question.

The ``hf`` backend runs with ``add_bos_token=True``: lmcli reads every context as ``<bos> text``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY_TEXT, assert_one_line_error, make_run, run_cli
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from lmcli.eval.downstream.formats import read_task
from lmcli.eval.downstream.kinds import KIND_OF, Scorer
from lmcli.eval.harness import LmcliLM, task_config, task_manager
from lmcli.formats.export.hf import export_hf
from lmcli.formats.sources import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))
from families import hf_folder  # noqa: E402

WORDS = sorted(set(TINY_TEXT.replace(".", "").split()))


def phrase(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of three harness tasks and their JSONL (lmcli's format: the same files)."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = random.Random(0)
    mc, cloze, gen = [], [], []
    for _ in range(24):
        choices = list(dict.fromkeys(phrase(rng, 1, 4) for _ in range(4)))
        mc.append({"context": phrase(rng, 2, 8), "choices": choices, "answer": rng.randrange(len(choices))})
        cloze.append({"context": phrase(rng, 2, 8), "target": " " + rng.choice(WORDS)})
        gen.append({"context": phrase(rng, 2, 8), "answer": rng.choice(WORDS)})
    for name, rows, kind in (
        ("tinymc", mc, "multiple_choice"),
        ("tinycloze", cloze, "cloze"),
        ("tinygen", gen[:8], "generation"),
    ):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = task_config(name, data, kind, until=(".",), max_gen_toks=6)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (what lmcli reads, the Hugging Face folder of the same weights)."""
    tmp = tmp_path_factory.mktemp("models")
    run = make_run(tmp / "run", kind="bpe")
    out = {name: (hf_folder(tmp, name),) * 2 for name in ("gpt2", "llama-tied")}
    out["lmcli-run"] = (run, export_hf(run, tmp / "run-hf"))
    return out


def per_question(results: dict, task: str, metric: str) -> list:
    return [s[metric] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama-tied", "lmcli-run"])
def test_lmcli_equals_the_harness_hf_backend_question_by_question(name: str, models, tasks: Path) -> None:
    ours_path, hf_path = models[name]
    manager = task_manager(["tinymc"], str(tasks))
    names = ["tinymc", "tinycloze", "tinygen"]
    common = dict(tasks=names, task_manager=manager, log_samples=True, bootstrap_iters=0)
    hf = simple_evaluate(
        model=HFLM(pretrained=str(hf_path), add_bos_token=True, batch_size=8, device="cpu"), **common
    )
    harness = simple_evaluate(model="lmcli", model_args=f"path={ours_path}", **common)
    for task, metric in (("tinymc", "acc"), ("tinymc", "acc_norm"), ("tinycloze", "acc")):
        assert per_question(harness, task, metric) == per_question(hf, task, metric), (task, metric)
    assert per_question(harness, "tinygen", "filtered_resps") == per_question(hf, "tinygen", "filtered_resps")
    theirs = hf["results"]["tinycloze"]["perplexity,none"]
    assert harness["results"]["tinycloze"]["perplexity,none"] == pytest.approx(theirs, rel=1e-4)

    ckpt = load_model(ours_path)
    scorer = Scorer(ckpt.model, ckpt.tokenizer)
    mc = read_task(tasks / "tinymc.jsonl")
    builtin = KIND_OF["multiple_choice"].score(scorer, mc.items, [])
    for metric in ("acc", "acc_norm"):
        assert [r[metric] for r in builtin] == per_question(hf, "tinymc", metric)
    assert 0 < sum(r["acc"] for r in builtin) < len(builtin)  # a random model: some right, some wrong
    cloze = read_task(tasks / "tinycloze.jsonl")
    scores = KIND_OF["cloze"].aggregate(KIND_OF["cloze"].score(scorer, cloze.items, []))
    assert scores["perplexity"] == pytest.approx(theirs, rel=1e-4)


def test_rolling_loglikelihood_equals_the_hf_backend(models) -> None:
    """Perplexity tasks (wikitext): each text in the harness's rolling windows of the model's
    context, the first predicted from <bos>; the hf backend without add_bos_token does the same
    on GPT-2, whose tokenizer adds no <bos> of its own."""
    folder, _ = models["gpt2"]
    texts = [TINY_TEXT[:400], TINY_TEXT[:20]]  # several windows of the context of 64; less than one
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    ours = LmcliLM(path=str(folder), device="cpu").loglikelihood_rolling(requests)
    theirs = HFLM(pretrained=str(folder), batch_size=8, device="cpu").loglikelihood_rolling(requests)
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_cli_harness_equals_the_builtin_scorer(models, tasks: Path, capsys) -> None:
    run, _ = models["lmcli-run"]
    argv = ["eval", str(run), "--task", str(tasks / "tinymc.jsonl"), "--harness", "tinymc"]
    code, out, err = run_cli([*argv, "--include-path", str(tasks), "--json", "--limit", "10"], capsys)
    assert code == 0, err
    report = json.loads(out)
    builtin, harness = report["tasks"]["tinymc"], report["harness"]["tinymc"]
    assert builtin["rows"] == harness["rows"] == 10
    assert (builtin["acc"], builtin["acc_norm"]) == (harness["acc"], harness["acc_norm"])
    assert report["combined"] == pytest.approx(builtin["acc_norm"])


def test_model_args_errors_are_one_line(tiny_run: Path) -> None:
    with pytest.raises(Exception, match="give path=RUN"):
        LmcliLM()
    with pytest.raises(Exception, match="unknown argument"):
        LmcliLM(path=str(tiny_run), temperature=1)


def test_harness_without_the_extra_says_what_to_install(tiny_run: Path, capsys, monkeypatch) -> None:
    harness = [n for n in sys.modules if n.split(".")[0] == "lm_eval" or n.startswith("lmcli.eval.harness")]
    for name in harness:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    code, _, err = run_cli(["eval", str(tiny_run), "--harness", "hellaswag"], capsys)
    assert_one_line_error(code, err, "--harness needs lm-evaluation-harness: pip install 'lmcli[harness]'")


@pytest.fixture
def no_builtin_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's own thousands of task YAMLs left out of its index (seconds to build)."""
    from lm_eval.tasks.manager import TaskManager

    init = TaskManager.__init__

    def local_only(self: TaskManager, *args: object, **kwargs: object) -> None:
        init(self, *args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(TaskManager, "__init__", local_only)


def test_a_harness_task_that_does_not_exist(tiny_run: Path, tasks: Path, capsys, no_builtin_tasks) -> None:
    argv = ["eval", str(tiny_run), "--harness", "tinymc,tinymcc", "--include-path", str(tasks)]
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, "no lm-evaluation-harness task named 'tinymcc' (did you mean tinymc")


def test_python_m_lmcli_harness_is_lm_eval_with_lmcli_models(
    tiny_run: Path, tasks: Path, capsys, monkeypatch, no_builtin_tasks
) -> None:
    from lmcli.eval.harness.__main__ import main

    argv = ["lm_eval", "--model", "lmcli", "--model_args", f"path={tiny_run}", "--device", "cpu"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--tasks", "tinymc", "--include_path", str(tasks), "--limit", "4"]
    )
    main()
    out = capsys.readouterr().out
    assert "lmcli ({'path'" in out and "|tinymc|" in out and "acc_norm" in out
    bad = ["lm_eval", "--model", "lmcli", "--model_args", "path=/nowhere", "--tasks", "tinymc"]
    monkeypatch.setattr(sys, "argv", [*bad, "--include_path", str(tasks)])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2 and "error: no such run or checkpoint folder" in capsys.readouterr().err
