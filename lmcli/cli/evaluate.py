"""``lmcli eval``: perplexity and bits per byte, downstream tasks, the lm-evaluation-harness."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import typer

from lmcli.cli.common import build, loaded_source
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    DeviceConfig,
    DownstreamConfig,
    EvalConfig,
)
from lmcli.errors import LmcliError


@config_options(EvalConfig, DownstreamConfig, DeviceConfig)
def eval_command(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder (or a Hugging Face folder)."),
    paths: list[str] | None = typer.Argument(
        None, help="Text files, folders, globs, .gz. [default: the run's validation split]"
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="With --per-line: write the JSONL here."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    *,
    options: dict[str, Any],
) -> None:
    """Perplexity and bits per byte of a model on held-out text; with --task or --harness, its
    scores on downstream tasks (multiple choice, cloze, generation)."""
    from lmcli.eval.perplexity import evaluate_run

    cfg = build(EvalConfig, options)
    tasks = build(DownstreamConfig, options)
    if tasks.wanted:
        _eval_tasks(run_dir, paths or [], cfg, tasks, json_out, options)
        return
    if cfg.kl_divergence is not None:
        _eval_divergence(run_dir, tuple(paths or ()), cfg, json_out, options)
        return
    if cfg.preferences is not None:
        if paths or cfg.per_line or cfg.dataset or cfg.source or cfg.target:
            raise LmcliError("--preferences scores pairs: give no text to evaluate with it")
        _eval_preferences(run_dir, cfg, json_out, options)
        return
    with loaded_source(run_dir, options) as ckpt:
        if cfg.per_line and (output is not None or not json_out):
            # each line's record is written as it is scored: memory stays flat however many lines
            score, what = _eval_per_line(ckpt, cfg, tuple(paths or ()), output)
        else:
            score, what = evaluate_run(ckpt, cfg, tuple(paths or ()), progress=not json_out)
        if not math.isfinite(score.mean_nll):
            raise LmcliError(
                f"{run_dir} gives a loss of {score.mean_nll} on {what}: it computes NaN or infinite "
                f"values (lmcli verify {run_dir} checks its weights)"
            )
        if score.unknown:
            print(
                f"warning: {score.unknown} character(s) unknown to the tokenizer became <unk>",
                file=sys.stderr,
            )
        if json_out:
            typer.echo(json.dumps({"evaluated": what, **score.report()}))
        else:
            _print_score(score, what, to_stderr=cfg.per_line and output is None)


def _eval_tasks(
    run_dir: Path,
    paths: list[str],
    cfg: EvalConfig,
    tasks: DownstreamConfig,
    json_out: bool,
    options: dict[str, Any],
) -> None:
    """``lmcli eval --task/--harness``: the task files read and the harness found before the model
    loads, every task scored, a table (or ``--json``) and the combined score."""
    from lmcli.eval.downstream.evaluate import chat_of, evaluate_tasks, load_tasks, report

    if paths or cfg.per_line or cfg.dataset or cfg.source or cfg.target:
        raise LmcliError("--task and --harness score task files: give no text to evaluate with them")
    files = load_tasks(tasks.task, tasks.limit, tasks.num_fewshot or 0)
    names = [n.strip() for n in (tasks.harness or "").split(",") if n.strip()]
    if tasks.harness is not None and not names:
        raise LmcliError("--harness: give task names, comma-separated (hellaswag,arc_easy)")
    harness = _harness() if names else None
    with loaded_source(run_dir, options) as ckpt:
        chat = chat_of(ckpt.tokenizer, ckpt.train_config, ckpt.path)
        results = evaluate_tasks(
            ckpt.model,
            ckpt.tokenizer,
            files,
            batch_size=cfg.batch_size,
            chat=chat,
            max_gen_tokens=tasks.max_gen_tokens,
            progress=not json_out,
        )
        if harness is not None:
            out = harness.run_harness(
                ckpt,
                names,
                include_path=tasks.include_path,
                limit=tasks.limit,
                num_fewshot=tasks.num_fewshot,
                batch_size=cfg.batch_size,
            )
            results += harness.harness_results(out)
    if json_out:
        typer.echo(json.dumps(report(results)))
    else:
        _print_tasks(results, str(run_dir))


def _eval_preferences(run_dir: Path, cfg: EvalConfig, json_out: bool, options: dict[str, Any]) -> None:
    """``lmcli eval --preferences FILE [--reference REF]``: preference accuracy and mean margin."""
    from lmcli.formats.sources import load_model
    from lmcli.train.post.dpo import score_preferences

    assert cfg.preferences is not None
    with loaded_source(run_dir, options) as ckpt:
        reference = None
        if cfg.reference is not None:
            param = next(ckpt.model.parameters())
            loaded = load_model(cfg.reference, param.device, param.dtype)
            if loaded.tokenizer.fingerprint != ckpt.tokenizer.fingerprint:
                raise LmcliError(f"--reference {cfg.reference} has another tokenizer than the model")
            reference = loaded.model
        scores = score_preferences(ckpt.model, ckpt.tokenizer, cfg.preferences, reference, cfg.batch_size)
    against = f" against {cfg.reference}" if cfg.reference else ""
    if json_out:
        typer.echo(json.dumps({"evaluated": cfg.preferences, "reference": cfg.reference, **scores}))
        return
    typer.echo(
        f"{cfg.preferences}{against}: preference accuracy {scores['accuracy']:.4f}, "
        f"mean margin {scores['margin']:.4f} nats ({scores['pairs']} pairs)"
    )


def _eval_divergence(
    run_dir: Path, paths: tuple[str, ...], cfg: EvalConfig, json_out: bool, options: dict[str, Any]
) -> None:
    """``lmcli eval MODEL TEXT --kl-divergence REFERENCE``: the model's next-token distributions
    against the reference's (float32) on the text: KL divergence, top-1 agreement, perplexities."""
    import torch

    from lmcli.data.corpus import open_corpus
    from lmcli.eval.divergence import divergence, text_ids
    from lmcli.formats.sources import load_model

    assert cfg.kl_divergence is not None
    if not (paths or cfg.dataset):
        raise LmcliError("--kl-divergence: give the text to compare the models on (files or --dataset)")
    corpus = open_corpus(paths, cfg.dataset, cfg.split, cfg.text_column)
    with loaded_source(run_dir, options) as ckpt:
        param = next(ckpt.model.parameters())
        ref = load_model(cfg.kl_divergence, param.device, torch.float32)
        if ref.tokenizer.fingerprint != ckpt.tokenizer.fingerprint:
            raise LmcliError(f"--kl-divergence {cfg.kl_divergence} has another tokenizer than the model")
        context = cfg.context or min(ckpt.model.config.block_size, ref.model.config.block_size)
        chunks = (chunk for doc in corpus.documents() for chunk in doc)
        ids = text_ids(ckpt.tokenizer, chunks)
        found = divergence(ckpt.model, ref.model, ids, context, cfg.stride or context, cfg.batch_size)
    report = found.report()
    if json_out:
        what = {"evaluated": corpus.description, "reference": cfg.kl_divergence}
        typer.echo(json.dumps({**what, **report}))
        return
    typer.echo(
        f"{corpus.description}, {report['tokens']:,} tokens, against {cfg.kl_divergence}:\n"
        f"  KL divergence  mean {report['kld_mean']:.6f}  median {report['kld_median']:.6f}  "
        f"p90 {report['kld_p90']:.6f}  p99 {report['kld_p99']:.6f}  max {report['kld_max']:.6f} nats\n"
        f"  top-1 agreement {100 * report['top1_agreement']:.2f}%\n"
        f"  perplexity {report['perplexity']:.4f} (reference {report['reference_perplexity']:.4f}), "
        f"ratio {report['perplexity_ratio']:.4f}"
    )


def _harness() -> Any:
    """``lmcli.eval.harness``, or a one-line error saying what to install."""
    try:
        import lmcli.eval.harness as harness
    except ImportError as exc:
        raise LmcliError(
            f"--harness needs lm-evaluation-harness: pip install 'lmcli[harness]' ({exc})"
        ) from None
    return harness


def _print_tasks(results: list[Any], what: str) -> None:
    """One row per task and score, as lm-evaluation-harness prints its table; the combined score."""
    from rich.console import Console
    from rich.table import Table

    from lmcli.eval.downstream.evaluate import combined

    table = Table(title=f"lmcli eval: {what}", title_justify="left")
    for column in ("task", "kind", "rows", "shots", "metric", "value"):
        table.add_column(column, justify="right" if column in ("rows", "shots", "value") else "left")
    for r in results:
        for n, (metric, value) in enumerate(r.scores.items()):
            head = (r.name, r.kind, str(r.rows), str(r.fewshot)) if n == 0 else ("", "", "", "")
            table.add_row(*head, metric + (" *" if metric == r.main else ""), f"{value:.4f}")
    Console().print(table)
    typer.echo(f"combined score (mean of the scores marked *): {combined(results):.4f}")


def _eval_per_line(ckpt: Any, cfg: EvalConfig, paths: tuple[str, ...], output: Path | None) -> Any:
    """``evaluate_run`` with each line's JSON record written to ``output`` (whole or not at all)
    or stdout as it is scored."""
    from lmcli.eval.perplexity import evaluate_run
    from lmcli.safe_io import temp_file

    if output is None:
        return evaluate_run(ckpt, cfg, paths, progress=False, on_line=lambda rec: print(json.dumps(rec)))
    tmp = temp_file(output)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            result = evaluate_run(
                ckpt, cfg, paths, progress=False, on_line=lambda rec: f.write(json.dumps(rec) + "\n")
            )
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return result


def _print_score(score: Any, what: str, to_stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lmcli eval: {what}", show_header=False, title_justify="left")
    rows = [
        ("tokens scored", f"{score.tokens:,}"),
        ("bytes scored", f"{score.bytes:,}"),
        ("mean NLL", f"{score.mean_nll:.4f} nats/token"),
        ("perplexity", f"{score.perplexity:.3f}"),
        ("bits per token", f"{score.bits_per_token:.4f}"),
        ("bits per byte", f"{score.bits_per_byte:.4f}"),
        ("unknown tokens", f"{score.unknown:,}"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    Console(stderr=to_stderr).print(table)
