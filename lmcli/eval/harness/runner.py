"""``lmcli eval --harness``: lm-evaluation-harness tasks scored with ``LmcliLM``, its results as
lmcli's ``TaskResult`` rows."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError
from lmcli.eval.downstream.evaluate import TaskResult
from lmcli.eval.downstream.kinds import DEFAULT_STOP, KIND_OF
from lmcli.eval.harness.lm import LmcliLM
from lmcli.formats.checkpoint import Checkpoint

MAIN_METRICS = ("acc_norm", "acc", "exact_match")  # the score a task adds to the combined one


def task_config(
    name: str, data: str | Path, kind: str, *, until: tuple[str, ...] = DEFAULT_STOP, max_gen_toks: int = 256
) -> dict[str, Any]:
    """The harness task (a task YAML's content; JSON is YAML) that reads an lmcli task file of
    ``kind`` (its rows in lmcli's format, few-shot rows aside) with the prompts, continuations and
    scores lmcli gives it: to compare lmcli's scorer with any harness backend on the same rows."""
    config: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "{{context}}",
    }
    if kind == "multiple_choice":
        config.update(output_type="multiple_choice", doc_to_choice="{{choices}}", doc_to_target="{{answer}}")
    elif kind == "cloze":
        config.update(output_type="loglikelihood", doc_to_target="{{target}}")
    else:
        gen = {"until": list(until), "max_gen_toks": max_gen_toks, "do_sample": False}
        config.update(output_type="generate_until", doc_to_target="{{answer}}", generation_kwargs=gen)
    config["metric_list"] = [{"metric": m} for m in KIND_OF[kind].metrics]
    return config


def task_manager(names: list[str], include_path: str | None = None) -> Any:
    """The harness's ``TaskManager`` that knows ``names``: the tasks of ``include_path`` alone
    when they are all there (indexing the harness's own thousands of YAML files takes seconds),
    else those and the harness's own; a name none holds is a one-line error."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise LmcliError(f"--include-path {include_path}: no such folder")
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in own.all_tasks for name in names):
            return own
    manager = TaskManager(include_path=include_path)
    for name in names:
        if name not in manager.all_tasks:
            near = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise LmcliError(f"no lm-evaluation-harness task named {name!r}{hint}")
    return manager


def run_harness(
    ckpt: Checkpoint,
    names: list[str],
    *,
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    log_samples: bool = False,
) -> dict[str, Any]:
    """The harness's ``simple_evaluate`` of ``ckpt`` on its tasks ``names``: its results dict."""
    from lm_eval import simple_evaluate

    manager = task_manager(names, include_path)
    lm = LmcliLM(checkpoint=ckpt, batch_size=batch_size)
    return simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=0,
    )


def harness_results(results: dict[str, Any]) -> list[TaskResult]:
    """Each task's scores from the harness's results dict: ``acc``, or ``metric/filter`` when the
    task filters (gsm8k's ``exact_match/strict-match``); standard errors left out."""
    out = []
    for task, fields in results["results"].items():
        scores = {}
        for key, value in fields.items():
            metric, _, filt = key.partition(",")
            if filt and not metric.endswith("_stderr") and isinstance(value, int | float):
                scores[metric if filt == "none" else f"{metric}/{filt}"] = float(value)
        main = next((k for m in MAIN_METRICS for k in scores if k == m or k.startswith(m + "/")), None)
        rows = results.get("n-samples", {}).get(task, {}).get("effective", 0)
        shots = results.get("n-shot", {}).get(task, 0)
        out.append(TaskResult(task, "harness", rows, shots, scores, main))
    return out
