"""``lmcli sample`` and ``lmcli beam``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from lmcli.cli.common import (
    RUN_DIR_HELP,
    build,
    load_draft,
    loaded_source,
    read_lines,
    warn_inputs,
    warn_prompts,
)
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    BeamConfig,
    ConstraintConfig,
    DeviceConfig,
    DraftConfig,
    SampleConfig,
)
from lmcli.config.files import to_dict
from lmcli.errors import LmcliError


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
    with loaded_source(run_dir, options) as ckpt:
        processors = constraint_of(build(ConstraintConfig, options), ckpt.tokenizer)
        task = make_task(ckpt.train_config)
        form = _chat_form(ckpt, task) if chat else task.prompt  # how this model reads a prompt
        draft = load_draft(options, ckpt)
        usable = form.usable_chars(ckpt.tokenizer, ckpt.model.config.block_size)  # of a long line
        texts = read_lines(prompt_file, prompt, usable + 1, form.keeps_end)
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
        warn_inputs(unknown, cut)
        if stream:
            typer.echo("")
        if ended:
            hint = "" if chat else "; an instruct model answers a question with --chat (its chat template)"
            print(
                f"warning: {ended} sample(s) ended at once: the model's first token was its end{hint}",
                file=sys.stderr,
            )


def constraint_of(cfg: ConstraintConfig, tokenizer: Any) -> Callable[[], tuple[Any, ...]]:
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
    from lmcli.generate.decoding import ChatPrompt
    from lmcli.text.chat_template import template_of

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
    refs = read_lines(reference, None) if reference is not None else None
    with loaded_source(run_dir, options) as ckpt:
        form = make_task(ckpt.train_config).prompt
        usable = form.usable_chars(ckpt.tokenizer, ckpt.model.config.block_size)  # of a long line
        texts = read_lines(input, prompt, usable + 1, form.keeps_end)
        if texts is None:
            raise LmcliError("no input: give --input FILE, --prompt TEXT, or pipe lines to stdin")
        if refs is not None and len(refs) != len(texts):
            raise LmcliError(f"{reference} has {len(refs)} lines but there are {len(texts)} inputs")
        results, prompts = beam_texts(ckpt.model, ckpt.tokenizer, texts, cfg, form=form)
        warn_prompts(prompts)
        best = [r.texts[0] if r.texts else "" for r in results]
        if output is not None:
            tmp = output.with_name(f".{output.name}.tmp")
            tmp.write_text("".join(b.replace("\n", " ") + "\n" for b in best), encoding="utf-8")
            os.replace(tmp, output)
        _print_hypotheses(results, cfg, json_out, to_stdout=output is None)
        if refs is not None:
            from lmcli.eval.bleu import score_translations

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
