"""The `lmcli` command line: each command turns options into a config and calls the library.

Errors the user can fix (``LmcliError``, bad option values, OS errors) print one line to stderr
and exit with code 2; nothing prints a traceback unless LMCLI_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click
import typer

from lmcli import __version__
from lmcli.errors import LmcliError

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as _typer_click
except ImportError:  # pragma: no cover - older typer uses click itself
    _typer_click = click.exceptions

_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, _typer_click.ClickException)

app = typer.Typer(
    name="lmcli",
    help="Train and use decoder-only Transformer language models.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


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
    lmcli eval    RUN_DIR       perplexity and bits per byte on held-out text
    lmcli sample  [RUN_DIR]     generate text (temperature, top-k, top-p, ...)
    lmcli beam    [RUN_DIR]     beam search, e.g. translation
    """


def given(**options: Any) -> dict[str, Any]:
    """The options the user actually gave (CLI options default to None)."""
    return {k: v for k, v in options.items() if v is not None and v != ()}


def _help(text: str, cls: type, name: str) -> str:
    """Option help with the dataclass default, so help and library never drift."""
    from lmcli.config import default_of

    default = default_of(cls, name)
    return f"{text} [default: {default}]" if default not in (None, "", ()) else text


_M = "ModelConfig"
_T = "TrainConfig"


def _cfg(kind: str) -> type:
    from lmcli import config

    return getattr(config, kind)


@app.command()
def train(
    corpus: list[str] | None = typer.Argument(
        None, help="Text files, folders (recursive), globs or .gz files. None: a built-in corpus."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="TOML (or JSON) file of options; flags override it."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this folder where it stopped."
    ),
    out: str | None = typer.Option(None, "--out", "-o", help="Run folder. [default: checkpoints/run-<time>]"),
    task: str | None = typer.Option(
        None, help=_help("lm (language modelling) or translation (source <sep> target).", _cfg(_T), "task")
    ),
    source: str | None = typer.Option(None, help="Translation: line-aligned source file (.gz allowed)."),
    target: str | None = typer.Option(None, help="Translation: line-aligned target file (.gz allowed)."),
    source_field: str | None = typer.Option(
        None,
        help=_help(
            "Translation: TSV/JSONL/dataset column or language of the source.", _cfg(_T), "source_field"
        ),
    ),
    target_field: str | None = typer.Option(
        None, help=_help("Translation: column or language of the target.", _cfg(_T), "target_field")
    ),
    val_source: str | None = typer.Option(None, help="Translation: validation source file."),
    val_target: str | None = typer.Option(None, help="Translation: validation target file."),
    prefix_lm: bool | None = typer.Option(
        None, "--prefix-lm/--no-prefix-lm", help="Translation: source tokens attend to each other both ways."
    ),
    dataset: str | None = typer.Option(
        None, help="Hugging Face dataset NAME[:CONFIG] (or a local data file)."
    ),
    text_column: str | None = typer.Option(
        None, help=_help("Dataset column holding the text.", _cfg(_T), "text_column")
    ),
    split: str | None = typer.Option(None, help=_help("Dataset split to train on.", _cfg(_T), "split")),
    val: str | None = typer.Option(None, help="Validation corpus (file, folder or glob) instead of a split."),
    val_fraction: float | None = typer.Option(
        None, help=_help("Last fraction of the corpus kept for validation.", _cfg(_T), "val_fraction")
    ),
    tokenizer: str | None = typer.Option(
        None,
        help=_help(
            "char, byte, bpe (trained on the corpus) or a tokenizer.json path.", _cfg(_T), "tokenizer"
        ),
    ),
    vocab_size: int | None = typer.Option(
        None, help=_help("Vocabulary size for bpe.", _cfg(_T), "vocab_size")
    ),
    cache_dir: str | None = typer.Option(
        None, help="Token cache folder. [default: ~/.cache/lmcli or $LMCLI_CACHE]"
    ),
    init_from: str | None = typer.Option(
        None, help="Start from a local Hugging Face GPT-2 folder (fine-tuning)."
    ),
    block_size: int | None = typer.Option(
        None, help=_help("Context length in tokens.", _cfg(_M), "block_size")
    ),
    n_layer: int | None = typer.Option(None, help=_help("Transformer blocks.", _cfg(_M), "n_layer")),
    n_head: int | None = typer.Option(None, help=_help("Attention heads.", _cfg(_M), "n_head")),
    n_embd: int | None = typer.Option(None, help=_help("Embedding width.", _cfg(_M), "n_embd")),
    d_ff: int | None = typer.Option(None, help="MLP width. [default: 4*n-embd, ~8/3*n-embd for swiglu]"),
    dropout: float | None = typer.Option(None, help=_help("Dropout rate.", _cfg(_M), "dropout")),
    position: str | None = typer.Option(
        None, help=_help("Positions: learned, sinusoidal, rope or alibi.", _cfg(_M), "position")
    ),
    mlp: str | None = typer.Option(None, help=_help("Feed-forward: gelu, relu or swiglu.", _cfg(_M), "mlp")),
    norm: str | None = typer.Option(
        None, help=_help("Normalization: layernorm or rmsnorm.", _cfg(_M), "norm")
    ),
    norm_placement: str | None = typer.Option(
        None, help=_help("Norm before (pre) or after (post) each sublayer.", _cfg(_M), "norm_placement")
    ),
    untie_embeddings: bool = typer.Option(
        False, "--untie-embeddings", help="Separate input and output embeddings."
    ),
    no_bias: bool = typer.Option(False, "--no-bias", help="No biases in linear layers and LayerNorm."),
    batch_size: int | None = typer.Option(
        None, help=_help("Sequences per micro-batch.", _cfg(_T), "batch_size")
    ),
    grad_accum: int | None = typer.Option(
        None, help=_help("Micro-batches per optimizer step.", _cfg(_T), "grad_accum")
    ),
    max_steps: int | None = typer.Option(
        None, help=f"Stop after this many steps. [default: {_cfg(_T).DEFAULT_STEPS} if no other limit]"
    ),
    epochs: float | None = typer.Option(None, help="Stop after this many passes over the corpus."),
    max_time: str | None = typer.Option(None, help="Stop (with a checkpoint) after this long: 90s, 30m, 2h."),
    lr: float | None = typer.Option(None, help=_help("Peak learning rate.", _cfg(_T), "lr")),
    min_lr_ratio: float | None = typer.Option(
        None, help=_help("Cosine floor as a fraction of --lr.", _cfg(_T), "min_lr_ratio")
    ),
    warmup_steps: int | None = typer.Option(
        None, help=_help("Linear warmup steps.", _cfg(_T), "warmup_steps")
    ),
    weight_decay: float | None = typer.Option(
        None, help=_help("AdamW weight decay (matrices only).", _cfg(_T), "weight_decay")
    ),
    beta1: float | None = typer.Option(None, help=_help("AdamW beta1.", _cfg(_T), "beta1")),
    beta2: float | None = typer.Option(None, help=_help("AdamW beta2.", _cfg(_T), "beta2")),
    grad_clip: float | None = typer.Option(
        None, help=_help("Clip the gradient norm to this (0: off).", _cfg(_T), "grad_clip")
    ),
    label_smoothing: float | None = typer.Option(
        None, help=_help("Label smoothing of the training loss.", _cfg(_T), "label_smoothing")
    ),
    eval_interval: int | None = typer.Option(
        None, help=_help("Validate every N steps.", _cfg(_T), "eval_interval")
    ),
    eval_batches: int | None = typer.Option(
        None, help=_help("Validation batches per evaluation.", _cfg(_T), "eval_batches")
    ),
    bleu_samples: int | None = typer.Option(
        None,
        help=_help(
            "Translation: validation pairs decoded greedily for BLEU (0: off).", _cfg(_T), "bleu_samples"
        ),
    ),
    bleu_interval: int | None = typer.Option(
        None, help="Translation: BLEU every N steps. [default: at every validation]"
    ),
    save_interval: int | None = typer.Option(
        None, help="Checkpoint every N steps. [default: at every validation]"
    ),
    keep_last: int | None = typer.Option(
        None, help=_help("Periodic step-N checkpoints to keep besides last and best.", _cfg(_T), "keep_last")
    ),
    log_interval: int | None = typer.Option(
        None, help=_help("Log metrics every N steps.", _cfg(_T), "log_interval")
    ),
    seed: int | None = typer.Option(
        None, help=_help("Random seed (weights, data order, dropout).", _cfg(_T), "seed")
    ),
    device: str | None = typer.Option(None, help=_help("auto, cpu, cuda or mps.", _cfg(_T), "device")),
    dtype: str | None = typer.Option(
        None, help=_help("auto (bf16 autocast on CUDA), float32, bfloat16, float16.", _cfg(_T), "dtype")
    ),
    compile: bool | None = typer.Option(None, "--compile/--no-compile", help="torch.compile the model."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No pre-flight table or progress bar."),
) -> None:
    """Train a decoder-only Transformer on a corpus (the built-in one when none is given).

    With --task translation it trains on parallel text (--source/--target files, one TSV/JSONL
    file, or --dataset), each pair as "<bos> source <sep> target <eos>" with the loss on the target.
    """
    from lmcli.config import load_config_file
    from lmcli.display import rich_reporter
    from lmcli.train import resolve_configs
    from lmcli.train import train as run_training

    options = given(
        task=task,
        source=source,
        target=target,
        source_field=source_field,
        target_field=target_field,
        val_source=val_source,
        val_target=val_target,
        prefix_lm=prefix_lm,
        corpus=tuple(corpus or ()),
        dataset=dataset,
        text_column=text_column,
        split=split,
        val=val,
        val_fraction=val_fraction,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        out=out,
        cache_dir=cache_dir,
        init_from=init_from,
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        d_ff=d_ff,
        dropout=dropout,
        position=position,
        mlp=mlp,
        norm=norm,
        norm_placement=norm_placement,
        batch_size=batch_size,
        grad_accum=grad_accum,
        max_steps=max_steps,
        epochs=epochs,
        max_time=max_time,
        lr=lr,
        min_lr_ratio=min_lr_ratio,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        grad_clip=grad_clip,
        label_smoothing=label_smoothing,
        eval_interval=eval_interval,
        eval_batches=eval_batches,
        bleu_samples=bleu_samples,
        bleu_interval=bleu_interval,
        save_interval=save_interval,
        keep_last=keep_last,
        log_interval=log_interval,
        seed=seed,
        device=device,
        dtype=dtype,
        compile=compile,
    )
    if untie_embeddings:
        options["tie_embeddings"] = False
    if no_bias:
        options["bias"] = False
    file_options = load_config_file(config) if config else {}
    model_cfg, train_cfg = resolve_configs(file_options, options, resume=resume)
    result = run_training(
        model_cfg, train_cfg, resume=resume, reporter=rich_reporter(quiet), progress=not quiet
    )
    if result.stopped in ("SIGINT", "SIGTERM"):
        raise typer.Exit(130 if result.stopped == "SIGINT" else 143)


# --- commands are defined below; each is a few lines: options -> config -> library call ---


def _read_lines(path: Path | None, inline: list[str] | None) -> list[str] | None:
    """Inputs from --prompt values, a file (one per line, .gz allowed), or piped stdin; None if none."""
    if inline:
        return list(inline)
    if path is not None:
        from lmcli.parallel import read_lines

        return read_lines(path)
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        return [line.rstrip("\r") for line in data.removesuffix("\n").split("\n")] if data else None
    return None


def _load(run_dir: Path | None, device: str) -> Any:
    from lmcli.hf import load_any
    from lmcli.runtime import pick_device

    return load_any(run_dir_or_latest(run_dir), pick_device(device))


def _warn_prompts(prompts: list[Any]) -> None:
    unknown = sum(p.unknown for p in prompts)
    if unknown:
        print(f"warning: {unknown} character(s) unknown to the tokenizer became <unk>", file=sys.stderr)
    cut = sum(p.truncated for p in prompts)
    if cut:
        print(f"warning: {cut} input(s) longer than the context were cut to fit", file=sys.stderr)


_S = "SampleConfig"
_B = "BeamConfig"


@app.command()
def sample(
    run_dir: Path | None = typer.Argument(
        None, help="Run or checkpoint folder. [default: newest in checkpoints/]"
    ),
    prompt: list[str] | None = typer.Option(None, "--prompt", "-p", help="Prompt text (repeatable)."),
    prompt_file: Path | None = typer.Option(None, help="Prompts, one per line, decoded as one batch."),
    max_new_tokens: int | None = typer.Option(
        None, help=_help("Tokens to generate.", _cfg(_S), "max_new_tokens")
    ),
    min_new_tokens: int | None = typer.Option(
        None, help=_help("No <eos> before this many tokens.", _cfg(_S), "min_new_tokens")
    ),
    temperature: float | None = typer.Option(
        None, help=_help("Softmax temperature; 0 = greedy.", _cfg(_S), "temperature")
    ),
    top_k: int | None = typer.Option(
        None, help=_help("Keep the k most likely tokens (0 = off).", _cfg(_S), "top_k")
    ),
    top_p: float | None = typer.Option(
        None, help=_help("Nucleus: smallest set with mass >= p.", _cfg(_S), "top_p")
    ),
    min_p: float | None = typer.Option(
        None, help=_help("Drop tokens below min-p x the top one.", _cfg(_S), "min_p")
    ),
    repetition_penalty: float | None = typer.Option(
        None, help=_help("> 1 discourages tokens already present.", _cfg(_S), "repetition_penalty")
    ),
    num_samples: int | None = typer.Option(None, help=_help("Samples per prompt.", _cfg(_S), "num_samples")),
    seed: int | None = typer.Option(None, help=_help("Same seed, same text.", _cfg(_S), "seed")),
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop when this text appears (repeatable)."),
    json_out: bool = typer.Option(
        False, "--json", help="JSONL: prompt, text, per-token log-probs, settings."
    ),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
) -> None:
    """Generate text from a trained model (an empty prompt starts from <bos>)."""
    import json

    from lmcli.config import SampleConfig, from_dict, to_dict
    from lmcli.sampling import sample_texts

    cfg = from_dict(
        SampleConfig,
        given(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            num_samples=num_samples,
            seed=seed,
            stop=tuple(stop or ()),
        ),
        source="options",
    )
    ckpt = _load(run_dir, device)
    translation = ckpt.train_config.task == "translation"
    texts = _read_lines(prompt_file, prompt)
    if texts is None:
        if translation:
            raise LmcliError(
                "this is a translation model: give the source text with --prompt, --prompt-file or stdin"
            )
        texts = [""]
    stream = not json_out and len(texts) * cfg.num_samples == 1
    if stream and not translation:
        typer.echo(texts[0], nl=False)
    on_text = (lambda row, piece: (sys.stdout.write(piece), sys.stdout.flush())) if stream else None
    out, prompts = sample_texts(
        ckpt.model,
        ckpt.tokenizer,
        texts,
        cfg,
        translation=translation,
        prefix_lm=ckpt.train_config.prefix_lm,
        on_text=on_text,
    )
    _warn_prompts(prompts)
    if stream:
        typer.echo("")
        return
    for g in out:
        if json_out:
            record = {
                "prompt": texts[g.prompt_index],
                "prompt_index": g.prompt_index,
                "sample": g.sample_index,
                "text": g.text,
                "tokens": g.ids,
                "logprobs": [round(x, 6) for x in g.logprobs],
                "finish_reason": g.finish_reason,
                "settings": to_dict(cfg),
            }
            typer.echo(json.dumps(record, ensure_ascii=False))
        else:
            typer.echo(f"--- prompt {g.prompt_index}, sample {g.sample_index} ({g.finish_reason}) ---")
            typer.echo(("" if translation else texts[g.prompt_index]) + g.text)


@app.command()
def beam(
    run_dir: Path | None = typer.Argument(
        None, help="Run or checkpoint folder. [default: newest in checkpoints/]"
    ),
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
    beam_size: int | None = typer.Option(None, help=_help("Beams per input.", _cfg(_B), "beam_size")),
    length_penalty: float | None = typer.Option(
        None, help=_help("alpha in score = logprob / length^alpha.", _cfg(_B), "length_penalty")
    ),
    max_new_tokens: int | None = typer.Option(
        None, help=_help("New-token limit.", _cfg(_B), "max_new_tokens")
    ),
    max_len_a: float | None = typer.Option(
        None, help="Limit new tokens to a * input_tokens + b (with --max-len-b)."
    ),
    max_len_b: int | None = typer.Option(None, help="See --max-len-a."),
    min_new_tokens: int | None = typer.Option(
        None, help=_help("No <eos> before this many tokens.", _cfg(_B), "min_new_tokens")
    ),
    nbest: int | None = typer.Option(None, help=_help("Hypotheses to print per input.", _cfg(_B), "nbest")),
    no_repeat_ngram_size: int | None = typer.Option(
        None, help=_help("Never repeat an n-gram of this size (0 = off).", _cfg(_B), "no_repeat_ngram_size")
    ),
    early_stopping: bool | None = typer.Option(
        None, "--early-stopping/--no-early-stopping", help="Stop an input once beam-size hypotheses ended."
    ),
    batch_size: int | None = typer.Option(
        None, help=_help("Inputs decoded together.", _cfg(_B), "batch_size")
    ),
    json_out: bool = typer.Option(False, "--json", help="JSONL: every hypothesis with score and log-prob."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
) -> None:
    """Beam search: continue prompts, or translate with a model trained with --task translation.

    Without --output, prints one line per hypothesis: input index, score, text.
    """
    import json

    from lmcli.beam import beam_texts
    from lmcli.config import BeamConfig, from_dict, to_dict

    cfg = from_dict(
        BeamConfig,
        given(
            beam_size=beam_size,
            length_penalty=length_penalty,
            max_new_tokens=max_new_tokens,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            min_new_tokens=min_new_tokens,
            nbest=nbest,
            no_repeat_ngram_size=no_repeat_ngram_size,
            early_stopping=early_stopping,
            batch_size=batch_size,
        ),
        source="options",
    )
    refs = _read_lines(reference, None) if reference is not None else None
    ckpt = _load(run_dir, device)
    texts = _read_lines(input, prompt)
    if texts is None:
        raise LmcliError("no input: give --input FILE, --prompt TEXT, or pipe lines to stdin")
    if refs is not None and len(refs) != len(texts):
        raise LmcliError(f"{reference} has {len(refs)} lines but there are {len(texts)} inputs")
    translation = ckpt.train_config.task == "translation"
    results, prompts = beam_texts(
        ckpt.model, ckpt.tokenizer, texts, cfg, translation=translation, prefix_lm=ckpt.train_config.prefix_lm
    )
    _warn_prompts(prompts)
    best = [r.texts[0] if r.texts else "" for r in results]
    if output is not None:
        tmp = output.with_name(f".{output.name}.tmp")
        tmp.write_text("".join(b.replace("\n", " ") + "\n" for b in best), encoding="utf-8")
        os.replace(tmp, output)
    for i, r in enumerate(results):
        if json_out:
            hyps = [
                {"text": t, "score": h.score, "logprob": h.logprob, "tokens": h.ids, "ended": h.ended}
                for h, t in zip(r.hypotheses, r.texts, strict=False)
            ]
            typer.echo(
                json.dumps(
                    {"index": i, "input": r.input, "hypotheses": hyps, "settings": to_dict(cfg)},
                    ensure_ascii=False,
                )
            )
        elif output is None:
            for h, t in zip(r.hypotheses, r.texts, strict=False):
                typer.echo(f"{i}\t{h.score:.4f}\t{t}")
            if not r.hypotheses:
                typer.echo(f"{i}\t\t")
    if refs is not None:
        from lmcli.bleu import score_translations

        metrics = score_translations(best, refs)
        if json_out:
            typer.echo(json.dumps(metrics))
        else:
            typer.echo(metrics["summary"], err=output is None)


_E = "EvalConfig"


@app.command("eval")
def eval_command(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder (or a Hugging Face GPT-2 folder)."),
    paths: list[str] | None = typer.Argument(
        None, help="Text files, folders, globs, .gz. [default: the run's validation split]"
    ),
    dataset: str | None = typer.Option(
        None, help="Hugging Face dataset NAME[:CONFIG] (or a local data file)."
    ),
    text_column: str = typer.Option("text", help="Dataset column holding the text."),
    split: str = typer.Option("test", help="Dataset split."),
    source: str | None = typer.Option(None, help="Translation model: source file (with --target)."),
    target: str | None = typer.Option(None, help="Translation model: target file (with --source)."),
    context: int | None = typer.Option(None, help="Tokens per window. [default: the model's block size]"),
    stride: int | None = typer.Option(
        None,
        help="Tokens between window starts; below the context, windows overlap and each token is "
        "still scored once, with more left context. [default: the context]",
    ),
    batch_size: int | None = typer.Option(
        None, help=_help("Windows per forward pass.", _cfg(_E), "batch_size")
    ),
    per_line: bool = typer.Option(
        False, "--per-line", help="Score each line on its own as <bos> line <eos>."
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="With --per-line: write the JSONL here."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
) -> None:
    """Perplexity and bits per byte of a model on held-out text."""
    import json

    from lmcli.config import EvalConfig, from_dict
    from lmcli.evaluate import evaluate_run

    cfg = from_dict(
        EvalConfig,
        given(context=context, stride=stride, batch_size=batch_size, per_line=per_line or None),
        source="options",
    )
    ckpt = _load(run_dir, device)
    score, what = evaluate_run(
        ckpt,
        cfg,
        tuple(paths or ()),
        dataset=dataset,
        text_column=text_column,
        split=split,
        source=source,
        target=target,
        progress=not json_out,
    )
    if score.unknown:
        print(f"warning: {score.unknown} character(s) unknown to the tokenizer became <unk>", file=sys.stderr)
    if per_line:
        lines = "".join(json.dumps(rec) + "\n" for rec in score.lines)
        if output is not None:
            output.write_text(lines)
        elif not json_out:
            sys.stdout.write(lines)
    report = {"evaluated": what, **score.report()}
    if json_out:
        typer.echo(json.dumps(report))
        return
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
    Console(stderr=per_line and output is None).print(table)


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="Run or checkpoint folder."),
    out_dir: Path = typer.Argument(..., help="Folder to write (must be new or empty)."),
    format: str = typer.Option("hf", "--format", help="hf: a Hugging Face GPT-2 folder (safetensors)."),
) -> None:
    """Export a checkpoint, e.g. as a Hugging Face GPT-2 folder that from_pretrained loads."""
    from lmcli.hf import export_hf

    if format != "hf":
        raise LmcliError(f"invalid format {format!r}: choose hf")
    typer.echo(f"wrote {export_hf(run_dir, out_dir)}")


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


def run_dir_or_latest(run_dir: Path | None) -> Path:
    """The given run folder, or the newest one under ``checkpoints/``."""
    from lmcli.checkpoint import find_latest_run

    return run_dir if run_dir is not None else find_latest_run(Path("checkpoints"))
