"""The `lmcli` command line: each command turns options into configs and calls the library.

The flags of every config field come from ``lmcli.options``; a command declares only its own
inputs and outputs (run folder, prompts, output files). Errors the user can fix
(``LmcliError``, bad option values, OS errors) print one line to stderr and exit with code 2;
nothing prints a traceback unless LMCLI_DEBUG=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
import typer
from typer.core import TyperCommand

from lmcli import __version__
from lmcli.config import (
    AverageConfig,
    BeamConfig,
    ChatConfig,
    ConstraintConfig,
    DeviceConfig,
    DownstreamConfig,
    DraftConfig,
    EvalConfig,
    ExportConfig,
    ModelConfig,
    SampleConfig,
    ServeConfig,
    TokenizeConfig,
    TrainConfig,
    field_names,
    from_dict,
    to_dict,
)
from lmcli.errors import LmcliError, Terminated
from lmcli.options import config_options

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as _typer_click
except ImportError:  # pragma: no cover - older typer uses click itself
    _typer_click = click.exceptions

_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, _typer_click.ClickException)
C = TypeVar("C")

app = typer.Typer(
    name="lmcli",
    help="Train and use decoder-only Transformer language models.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RUN_DIR_HELP = "Run or checkpoint folder, Hugging Face folder or GGUF file. [default: newest in checkpoints/]"


class SectionedCommand(TyperCommand):
    """Plain help as every command's, with options grouped under headings: a config section's
    title (``rich_help_panel``, set by ``lmcli.options``), the command's own under Options."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        groups: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                argument = param.param_type_name == "argument"
                heading = "Arguments" if argument else getattr(param, "rich_help_panel", None) or "Options"
                groups.setdefault(heading, []).append(record)
        for heading, rows in groups.items():
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Train and use decoder-only Transformer language models.

    \b
    lmcli train   [CORPUS...]   train a model (built-in corpus when none is given)
    lmcli eval    RUN_DIR       perplexity and bits per byte, or scores on downstream tasks
    lmcli tokenize CORPUS... -o DIR   tokenize a large corpus into shards, on every core
    lmcli sample  [RUN_DIR]     generate text (temperature, top-k, top-p, ...)
    lmcli beam    [RUN_DIR]     beam search, e.g. translation
    lmcli export  RUN_DIR OUT   a Hugging Face folder (GPT-2, Llama or Qwen2) or a GGUF file
    lmcli average RUN_DIR       average a run's last saved checkpoints into a new one
    lmcli serve   [RUN_DIR]     an OpenAI-compatible server and a chat page
    lmcli chat    [RUN_DIR]     chat in the terminal, or answer messages JSON on stdin
    lmcli verify  RUN_DIR       check a run folder, a Hugging Face folder or a GGUF file
    """


def build(cls: type[C], options: dict[str, Any]) -> C:
    """The config ``cls`` from the given options that are its fields (defaults for the rest)."""
    names = field_names(cls)
    return from_dict(cls, {k: v for k, v in options.items() if k in names}, source="options")


# ----------------------------------------------------------------------------- train


@app.command(cls=SectionedCommand)
@config_options(TrainConfig, ModelConfig)
def train(
    config: Path | None = typer.Option(
        None, "--config", help="TOML (or JSON) file of options; flags override it."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this folder where it stopped."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No pre-flight table or progress bar."),
    *,
    options: dict[str, Any],
) -> None:
    """Train a decoder-only Transformer on a corpus (the built-in one when none is given).

    With --task translation it trains on parallel text (--source/--target files, one TSV/JSONL
    file, or --dataset), each pair as "<bos> source <sep> target <eos>" with the loss on the target.
    """
    from lmcli.config import load_config_file
    from lmcli.train import resolve_configs
    from lmcli.train import train as run_training
    from lmcli.train.display import rich_reporter

    file_options = load_config_file(config) if config else {}
    model_cfg, train_cfg = resolve_configs(file_options, options, resume=resume)
    try:
        result = run_training(
            model_cfg, train_cfg, resume=resume, reporter=rich_reporter(quiet), progress=not quiet
        )
    except Terminated:  # a SIGTERM before training began: cleaned up as a Ctrl-C is
        raise typer.Exit(143) from None
    if result.stopped in ("SIGINT", "SIGTERM"):
        raise typer.Exit(130 if result.stopped == "SIGINT" else 143)


@app.command(cls=SectionedCommand)
@config_options(TokenizeConfig, exclude=("val", "val_fraction", "align_documents", "document_mask"))
def tokenize(
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    *,
    options: dict[str, Any],
) -> None:
    """Tokenize a corpus into a folder of token shards, on every core; `lmcli train DIR` trains on it.

    Reads what `lmcli train` reads (files, folders, globs, .gz/.zst, JSONL/parquet columns,
    --dataset in streaming mode) in flat memory. Run again after an interruption: finished
    shards are kept and the rest is done.
    """
    import time

    from lmcli.data.token_cache import tokenize_to

    t0 = time.perf_counter()
    cfg = build(TokenizeConfig, options)
    folder = tokenize_to(cfg, progress=not quiet)
    if quiet:
        return
    index, seconds = folder.index, time.perf_counter() - t0
    done = "already tokenized" if folder.cached else f"{index['bytes'] / 1e6 / seconds:.2f} MB/s"
    print(
        f"{index['n_tokens']:,} tokens ({index['documents']:,} document(s), {index['bytes']:,} bytes) "
        f"in {len(index['shards'])} shard(s) of {index['dtype']}: {folder.path} ({done})",
        file=sys.stderr,
    )


# ----------------------------------------------------------------------------- inputs and models


def _read_lines(path: Path | None, inline: list[str] | None) -> list[str] | None:
    """Inputs from --prompt values, a file (one per line, .gz allowed), or piped stdin; None if none."""
    if inline:
        return list(inline)
    if path is not None:
        from lmcli.data.corpus import read_lines

        return read_lines(path)
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        return [line.rstrip("\r") for line in data.removesuffix("\n").split("\n")] if data else None
    return None


def _load(run_dir: Path | None, options: dict[str, Any]) -> Any:
    """The checkpoint to decode or evaluate with, on the device the options ask for, with the
    CPU threads they ask for and its linear layers quantized as asked (``--quantize``)."""
    from lmcli.device import pick_device, set_threads
    from lmcli.quant import quantize
    from lmcli.sources import DTYPES, load_model

    cfg = build(DeviceConfig, options)
    set_threads(cfg.threads)
    ckpt = load_model(run_dir, pick_device(cfg.device), DTYPES.get(cfg.dtype))
    quantize(ckpt.model, cfg.quantize, cfg.group_size)
    return ckpt


@contextlib.contextmanager
def _loaded(run_dir: Path | None, options: dict[str, Any]) -> Iterator[Any]:
    """``_load``'s checkpoint, used inside its device's precision scope: TF32 matmuls and, on a
    GPU, bf16 autocast for float32 weights, as in training (``lmcli.device.inference_dtype``)."""
    from lmcli.device import inference_dtype, precision

    ckpt = _load(run_dir, options)
    param = next(ckpt.model.parameters())
    amp = inference_dtype(param.device, build(DeviceConfig, options).dtype, param.dtype)
    with precision(param.device, amp):
        yield ckpt


def _load_draft(options: dict[str, Any], ckpt: Any) -> Any:
    """``--draft``'s model (on the model's device and dtype), its tokenizer checked against the
    model's; None without ``--draft``."""
    cfg = build(DraftConfig, options)
    if cfg.draft is None:
        return None
    from lmcli.generate.speculative import Draft, check_draft
    from lmcli.sources import load_model

    param = next(ckpt.model.parameters())
    draft = load_model(cfg.draft, param.device, param.dtype)
    check_draft(ckpt.tokenizer, draft.tokenizer, cfg.draft)
    return Draft(draft.model, draft.tokenizer, cfg.draft_tokens)


def _warn_prompts(prompts: list[Any]) -> None:
    _warn_inputs(sum(p.unknown for p in prompts), sum(p.truncated for p in prompts))


def _warn_inputs(unknown: int, cut: int) -> None:
    if unknown:
        print(f"warning: {unknown} character(s) unknown to the tokenizer became <unk>", file=sys.stderr)
    if cut:
        print(f"warning: {cut} input(s) longer than the context were cut to fit", file=sys.stderr)


# ----------------------------------------------------------------------------- sample


@app.command()
@config_options(SampleConfig, ConstraintConfig, DraftConfig, DeviceConfig)
def sample(
    run_dir: Path | None = typer.Argument(None, help=RUN_DIR_HELP),
    prompt: list[str] | None = typer.Option(None, "--prompt", "-p", help="Prompt text (repeatable)."),
    prompt_file: Path | None = typer.Option(
        None, help="Prompts, one per line, decoded in batches; samples print in order as they finish."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="JSONL: prompt, text, per-token log-probs, settings."
    ),
    chat: bool = typer.Option(
        False,
        "--chat",
        help="Each prompt is a user's message in the model's chat template; prints the reply "
        "(an instruct model answers a question so).",
    ),
    *,
    options: dict[str, Any],
) -> None:
    """Generate text from a trained model (an empty prompt starts from <bos>)."""
    from lmcli.generate.sampling import iter_samples
    from lmcli.tasks import make_task

    cfg = build(SampleConfig, options)
    with _loaded(run_dir, options) as ckpt:
        processors = _constraint(build(ConstraintConfig, options), ckpt.tokenizer)
        task = make_task(ckpt.train_config)
        form = _chat_form(ckpt, task) if chat else task.prompt  # how this model reads a prompt
        draft = _load_draft(options, ckpt)
        texts = _read_lines(prompt_file, prompt)
        if texts is None:
            if not form.decodes(""):
                raise LmcliError(task.refusal("give the source text with --prompt, --prompt-file or stdin"))
            texts = [""]
        stream = not json_out and len(texts) * cfg.num_samples == 1
        if stream and form.shows_text:
            typer.echo(texts[0], nl=False)
        on_text = (lambda row, piece: (sys.stdout.write(piece), sys.stdout.flush())) if stream else None
        unknown = cut = ended = 0
        rules = {"form": form, "on_text": on_text, "draft": draft, "processors": processors}
        samples = iter_samples(ckpt.model, ckpt.tokenizer, texts, cfg, **rules)
        for g, p in samples:
            # printed as each batch finishes: memory flat in the number of prompts
            if g.sample_index == 0:
                unknown, cut = unknown + p.unknown, cut + p.truncated
            ended += g.finish_reason == "eos" and not g.ids
            if not stream:
                _print_sample(g, texts, cfg, json_out, form.shows_text, draft)
        _warn_inputs(unknown, cut)
        if stream:
            typer.echo("")
        if ended:
            hint = "" if chat else "; an instruct model answers a question with --chat (its chat template)"
            print(
                f"warning: {ended} sample(s) ended at once: the model's first token was its end{hint}",
                file=sys.stderr,
            )


def _constraint(cfg: ConstraintConfig, tokenizer: Any) -> Callable[[], tuple[Any, ...]]:
    """Each row's processors for the options' constraint (none without one); the constraint is
    compiled here, so a bad one fails before any decoding."""
    from lmcli.generate.constrain import Grammars, read_constraint

    constraint = read_constraint(cfg.json_schema, cfg.regex, cfg.grammar)
    if constraint is None:
        return tuple
    grammars = Grammars(tokenizer, cache=1)
    grammars.compile(constraint)
    return lambda: (grammars.processor(constraint),)


def _chat_form(ckpt: Any, task: Any) -> Any:
    """``sample --chat``: prompts in the model's chat template (its own, else lmcli's)."""
    from lmcli.chat_template import template_of
    from lmcli.generate.decoding import ChatPrompt

    if not task.chat:
        raise LmcliError(task.refusal("--chat does not apply"))
    return ChatPrompt(template_of(ckpt))


def _print_sample(
    g: Any, texts: list[str], cfg: SampleConfig, json_out: bool, shows_text: bool, draft: Any = None
) -> None:
    if json_out:
        record = {
            "prompt": texts[g.prompt_index],
            "prompt_index": g.prompt_index,
            "sample": g.sample_index,
            "text": g.text,
            "tokens": g.ids,
            "logprobs": [round(x, 6) for x in g.logprobs],
            "finish_reason": g.finish_reason,
            **g.speed.report(),
            "settings": to_dict(cfg),
        }
        if draft is not None:
            record["draft"] = {"tokens": draft.tokens, "proposed": g.drafted, "accepted": g.accepted}
        typer.echo(json.dumps(record, ensure_ascii=False))
    else:
        typer.echo(f"--- prompt {g.prompt_index}, sample {g.sample_index} ({g.finish_reason}) ---")
        typer.echo((texts[g.prompt_index] if shows_text else "") + g.text)


# ----------------------------------------------------------------------------- beam


@app.command()
@config_options(BeamConfig, DeviceConfig)
def beam(
    run_dir: Path | None = typer.Argument(None, help=RUN_DIR_HELP),
    input: Path | None = typer.Option(None, "--input", "-i", help="Inputs, one per line. [default: stdin]"),
    prompt: list[str] | None = typer.Option(
        None, "--prompt", "-p", help="An input given inline (repeatable)."
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Write the best hypothesis of each input here, one line per input line."
    ),
    reference: Path | None = typer.Option(
        None, help="Reference translations: report sacreBLEU BLEU and chrF."
    ),
    json_out: bool = typer.Option(False, "--json", help="JSONL: every hypothesis with score and log-prob."),
    *,
    options: dict[str, Any],
) -> None:
    """Beam search: continue prompts, or translate with a model trained with --task translation.

    Without --output, prints one line per hypothesis: input index, score, text.
    """
    from lmcli.generate.beam import beam_texts
    from lmcli.tasks import make_task

    cfg = build(BeamConfig, options)
    refs = _read_lines(reference, None) if reference is not None else None
    with _loaded(run_dir, options) as ckpt:
        texts = _read_lines(input, prompt)
        if texts is None:
            raise LmcliError("no input: give --input FILE, --prompt TEXT, or pipe lines to stdin")
        if refs is not None and len(refs) != len(texts):
            raise LmcliError(f"{reference} has {len(refs)} lines but there are {len(texts)} inputs")
        form = make_task(ckpt.train_config).prompt
        results, prompts = beam_texts(ckpt.model, ckpt.tokenizer, texts, cfg, form=form)
        _warn_prompts(prompts)
        best = [r.texts[0] if r.texts else "" for r in results]
        if output is not None:
            tmp = output.with_name(f".{output.name}.tmp")
            tmp.write_text("".join(b.replace("\n", " ") + "\n" for b in best), encoding="utf-8")
            os.replace(tmp, output)
        _print_hypotheses(results, cfg, json_out, to_stdout=output is None)
        if refs is not None:
            from lmcli.bleu import score_translations

            metrics = score_translations(best, refs)
            if json_out:
                typer.echo(json.dumps(metrics))
            else:
                typer.echo(metrics["summary"], err=output is None)


def _print_hypotheses(results: list[Any], cfg: BeamConfig, json_out: bool, to_stdout: bool) -> None:
    for i, r in enumerate(results):
        if json_out:
            hyps = [
                {"text": t, "score": h.score, "logprob": h.logprob, "tokens": h.ids, "ended": h.ended}
                for h, t in zip(r.hypotheses, r.texts, strict=False)
            ]
            record = {"index": i, "input": r.input, "hypotheses": hyps, "settings": to_dict(cfg)}
            typer.echo(json.dumps(record, ensure_ascii=False))
        elif to_stdout:
            for h, t in zip(r.hypotheses, r.texts, strict=False):
                typer.echo(f"{i}\t{h.score:.4f}\t{t}")
            if not r.hypotheses:
                typer.echo(f"{i}\t\t")


# ----------------------------------------------------------------------------- eval


@app.command("eval")
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
    from lmcli.evaluate import evaluate_run

    cfg = build(EvalConfig, options)
    tasks = build(DownstreamConfig, options)
    if tasks.wanted:
        _eval_tasks(run_dir, paths or [], cfg, tasks, json_out, options)
        return
    with _loaded(run_dir, options) as ckpt:
        if cfg.per_line and (output is not None or not json_out):
            # each line's record is written as it is scored: memory stays flat however many lines
            score, what = _eval_per_line(ckpt, cfg, tuple(paths or ()), output)
        else:
            score, what = evaluate_run(ckpt, cfg, tuple(paths or ()), progress=not json_out)
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
    from lmcli.downstream.run import chat_of, evaluate_tasks, load_tasks, report

    if paths or cfg.per_line or cfg.dataset or cfg.source or cfg.target:
        raise LmcliError("--task and --harness score task files: give no text to evaluate with them")
    files = load_tasks(tasks.task, tasks.limit, tasks.num_fewshot or 0)
    names = [n.strip() for n in (tasks.harness or "").split(",") if n.strip()]
    if tasks.harness is not None and not names:
        raise LmcliError("--harness: give task names, comma-separated (hellaswag,arc_easy)")
    harness = _harness() if names else None
    with _loaded(run_dir, options) as ckpt:
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


def _harness() -> Any:
    """``lmcli.harness``, or a one-line error saying what to install."""
    try:
        import lmcli.harness as harness
    except ImportError as exc:
        raise LmcliError(
            f"--harness needs lm-evaluation-harness: pip install 'lmcli[harness]' ({exc})"
        ) from None
    return harness


def _print_tasks(results: list[Any], what: str) -> None:
    """One row per task and score, as lm-evaluation-harness prints its table; the combined score."""
    from rich.console import Console
    from rich.table import Table

    from lmcli.downstream.run import combined

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
    from lmcli.evaluate import evaluate_run
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


# ----------------------------------------------------------------------------- export


@app.command()
@config_options(ExportConfig)
def export(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder, Hugging Face folder or GGUF file."),
    out_dir: Path | None = typer.Argument(
        None, help="Folder (hf, must be new or empty) or file (gguf, must be new) to write."
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="The same as OUT_DIR. [default for gguf: RUN-DTYPE.gguf here]"
    ),
    *,
    options: dict[str, Any],
) -> None:
    """Export a checkpoint: a Hugging Face folder that from_pretrained loads, a GGUF file for llama.cpp,
    or (a LoRA run, --merge) a plain lmcli checkpoint."""
    cfg = build(ExportConfig, options)
    if out_dir is not None and out is not None and out_dir != out:
        raise LmcliError("give the output once: as OUT or as --out")
    target = out_dir if out_dir is not None else out
    from lmcli.lora_run import is_lora_run
    from lmcli.sources import export_checkpoint

    if is_lora_run(run_dir) != cfg.merge:
        raise LmcliError(
            f"{run_dir} is a LoRA run: give --merge to fold its adapters into the weights"
            if not cfg.merge
            else f"--merge: {run_dir} has no LoRA adapters to fold"
        )
    if cfg.format == "lmcli":
        if target is None:
            raise LmcliError("give the folder to write (OUT or --out)")
        typer.echo(f"wrote {export_checkpoint(run_dir, target)}")
        return
    if cfg.format == "gguf":
        from lmcli.hf.gguf import export_gguf

        typer.echo(f"wrote {export_gguf(run_dir, target, cfg.gguf_type)}")
        return
    from lmcli.hf.export import export_hf

    if target is None:
        raise LmcliError("give the folder to write (OUT or --out)")
    typer.echo(f"wrote {export_hf(run_dir, target)}")


@app.command()
@config_options(AverageConfig)
def average(
    run_dir: Path = typer.Argument(..., help="Run folder with step-N checkpoints (--keep-last)."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Checkpoint folder to write (new). [default: RUN/average-last-N]"
    ),
    *,
    options: dict[str, Any],
) -> None:
    """Average the weights of a run's last N saved checkpoints into a new checkpoint folder."""
    from lmcli.train.averaging import average_checkpoints

    cfg = build(AverageConfig, options)
    typer.echo(f"wrote {average_checkpoints(run_dir, cfg.last, out)}")


# ----------------------------------------------------------------------------- serve


@app.command()
@config_options(ServeConfig, DeviceConfig)
def serve(
    run_dir: Path | None = typer.Argument(None, help=RUN_DIR_HELP),
    *,
    options: dict[str, Any],
) -> None:
    """Serve a model over HTTP: OpenAI-compatible completions and chat, and a chat page at /.

    Stops on SIGTERM or Ctrl-C: no new connections, in-flight requests get --grace seconds.
    """
    try:
        from lmcli.serve.server import serve as run_server
    except ImportError as exc:
        raise LmcliError(f"lmcli serve needs the serve extra (pip install 'lmcli[serve]'): {exc}") from None

    cfg = build(ServeConfig, options)
    if cfg.api_key is None and os.environ.get("LMCLI_API_KEY"):
        cfg = build(ServeConfig, {**options, "api_key": os.environ["LMCLI_API_KEY"]})
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        print(
            f"warning: listening on {cfg.host} without --api-key: anyone who reaches it can use it",
            file=sys.stderr,
        )
    with _loaded(run_dir, options) as ckpt:
        threads = build(DeviceConfig, options).threads
        run_server(ckpt, cfg, threads=threads, announce=lambda line: print(line, file=sys.stderr, flush=True))


# ----------------------------------------------------------------------------- chat


@app.command()
@config_options(
    ChatConfig, SampleConfig, ConstraintConfig, DraftConfig, DeviceConfig, exclude=("num_samples",)
)
def chat(
    run_dir: Path | None = typer.Argument(None, help=RUN_DIR_HELP),
    json_io: bool = typer.Option(
        False,
        "--json",
        help='Read {"messages": [...]} (or a list) from stdin, print the reply as JSON. '
        "[default: when stdin is not a terminal]",
    ),
    *,
    options: dict[str, Any],
) -> None:
    """Chat with a model: streamed replies, history, /reset, /system, /save, /help, /exit.

    Ctrl-C stops a reply and keeps the conversation; at the prompt it quits, as Ctrl-D does.
    """
    from lmcli.chat import ChatSession, dropped_notice, run_json, run_terminal

    cfg = build(SampleConfig, options)
    chat_cfg = build(ChatConfig, options)
    with _loaded(run_dir, options) as ckpt:
        processors = _constraint(build(ConstraintConfig, options), ckpt.tokenizer)
        draft = _load_draft(options, ckpt)
        session = ChatSession.from_checkpoint(ckpt, cfg, chat_cfg.system, draft=draft, processors=processors)
        try:
            if json_io or not sys.stdin.isatty():
                result = run_json(session, sys.stdin)
                if result["dropped_messages"]:
                    notice = dropped_notice(result["dropped_messages"], session.context)
                    print(f"warning: {notice}", file=sys.stderr)
                typer.echo(json.dumps(result, ensure_ascii=False))
                return
            from lmcli import fastpath

            with fastpath.inference(ckpt.model):  # one scope for every reply
                run_terminal(session, str(ckpt.path))
        finally:
            session.close()


# ----------------------------------------------------------------------------- verify


@app.command()
def verify(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder, Hugging Face folder or GGUF file."),
) -> None:
    """Check a model without building it: a run folder's files, links, checksums, configs, weight
    shapes and sizes against the config, tokenizer, trainer state, LoRA adapters; a Hugging Face
    folder's config, tokenizer and shards; a GGUF file's header and tensors. One line per
    checkpoint."""
    from lmcli.verify import verify_run

    for report in verify_run(run_dir):
        typer.echo(report.line())


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point with one-line errors and conventional exit codes."""
    debug = os.environ.get("LMCLI_DEBUG") == "1"
    try:
        code = app(args=argv, standalone_mode=False)  # an exit code when a command exits early
        if isinstance(code, int) and code:
            sys.exit(code)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _ABORT:
        print("error: aborted", file=sys.stderr)
        sys.exit(130)
    except _USAGE as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `lmcli`: show the help
            print(exc.format_message())
            sys.exit(0)
        if debug:
            raise
        print(f"error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except LmcliError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:
        if debug:
            raise
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(f"error: {exc.strerror or exc}{where}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # a bug: still one line, with a way to see more
        if debug:
            raise
        print(
            f"error: internal error: {type(exc).__name__}: {exc} (set LMCLI_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        sys.exit(1)
