"""``lmcli chat`` in the terminal and on JSON stdin."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Any

import typer

from lmcli.cli.common import RUN_DIR_HELP, build, load_draft, loaded_source
from lmcli.cli.decode import constraint_of
from lmcli.cli.options import config_options
from lmcli.config.commands import (
    ChatConfig,
    ConstraintConfig,
    DeviceConfig,
    DraftConfig,
    SampleConfig,
)
from lmcli.errors import LmcliError
from lmcli.generate.chat import ChatSession

STDIN_LIMIT = 16 << 20  # bytes of JSON on stdin: far more than any context holds


def read_messages(stream: IO[str] | IO[bytes]) -> Any:
    """``{"messages": [...]}`` or a bare list of messages, read from ``stream`` (UTF-8, at most
    ``STDIN_LIMIT`` bytes)."""
    raw = getattr(stream, "buffer", stream).read(STDIN_LIMIT + 1)
    if len(raw) > STDIN_LIMIT:
        raise LmcliError(f"stdin holds more than {STDIN_LIMIT >> 20} MiB: not a conversation lmcli reads")
    try:
        data = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise LmcliError(f"stdin is not UTF-8 text: byte {raw[exc.start]:#04x} at {exc.start}") from None
    if not data.strip():
        raise LmcliError('no input: give {"messages": [...]} on stdin')
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise LmcliError(f"stdin is not valid JSON: {reason}") from None
    if isinstance(value, dict):
        if "messages" not in value:
            raise LmcliError('the JSON object on stdin must have "messages"')
        value = value["messages"]
    return value


def run_json(session: ChatSession, stream: IO[str]) -> dict[str, Any]:
    """Answer the conversation read from ``stream``: the reply as a JSON-ready dict."""
    session.load(read_messages(stream))
    reply = session.reply()
    return {
        "message": {"role": "assistant", "content": reply.text},
        "finish_reason": reply.finish_reason,
        "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens},
        "dropped_messages": reply.dropped,
    }


HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone clears it)
  /save FILE      write the conversation as {"messages": [...]} JSON
  /help           this list
  /exit           quit (or Ctrl-D; Ctrl-C stops a reply, or quits at the prompt)"""


def dropped_notice(n: int, context: int) -> str:
    return f"[context of {context} tokens full: left out the {n} oldest message(s)]"


def run_terminal(session: ChatSession, title: str) -> None:
    """The interactive chat: read a line, stream the reply, until /exit, Ctrl-D or Ctrl-C at
    the prompt. Notices and errors go to stderr; the replies to stdout."""
    from rich.console import Console

    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:  # pragma: no cover - not on every platform
        pass
    note = Console(stderr=True, highlight=False, soft_wrap=True)
    note.print(f"lmcli chat: {title} (context {session.context} tokens). /help for commands.", markup=False)
    if session.system:
        note.print(f"system: {session.system}", style="dim", markup=False)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        try:
            if line.startswith("/"):
                if not _command(session, line, note):
                    return
            elif line.strip():
                _turn(session, line, note)
        except KeyboardInterrupt:  # outside a reply (which stops itself): back to the prompt
            print()


def _turn(session: ChatSession, line: str, note: Any) -> None:
    """Send one user message; stream the reply and print what the reader should know."""
    try:
        reply = session.say(line, on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    except LmcliError as exc:
        note.print(f"error: {exc}", style="red", markup=False)
        return
    print()
    if reply.dropped:
        note.print(dropped_notice(reply.dropped, session.context), style="yellow", markup=False)
    if reply.finish_reason == "interrupted":
        note.print("[reply stopped]", style="yellow", markup=False)
    elif reply.finish_reason == "length":
        note.print(f"[reply cut at {reply.completion_tokens} tokens]", style="dim", markup=False)


def _command(session: ChatSession, line: str, note: Any) -> bool:
    """Run one /command; False to end the session."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        note.print("[conversation cleared]", style="dim", markup=False)
    elif name == "/system":
        session.set_system(arg)
        note.print(f"[system prompt {'set' if arg else 'cleared'}]", style="dim", markup=False)
    elif name == "/save":
        if not arg:
            note.print("error: /save needs a file name", style="red", markup=False)
            return True
        try:
            path = session.save(arg)
        except (OSError, LmcliError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            note.print(f"error: cannot write {arg}: {reason}", style="red", markup=False)
            return True
        note.print(f"[saved {len(session.conversation())} message(s) to {path}]", style="dim", markup=False)
    elif name == "/help":
        note.print(HELP, markup=False)
    else:
        note.print(f"unknown command {name}: /help lists them", style="red", markup=False)
    return True


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
    from lmcli.cli.chat import dropped_notice, run_json, run_terminal
    from lmcli.generate.chat import ChatSession

    cfg = build(SampleConfig, options)
    chat_cfg = build(ChatConfig, options)
    with loaded_source(run_dir, options) as ckpt:
        processors = constraint_of(build(ConstraintConfig, options), ckpt.tokenizer)
        draft = load_draft(options, ckpt)
        session = ChatSession.from_checkpoint(ckpt, cfg, chat_cfg.system, draft=draft, processors=processors)
        try:
            if json_io or not sys.stdin.isatty():
                result = run_json(session, sys.stdin)
                if result["dropped_messages"]:
                    notice = dropped_notice(result["dropped_messages"], session.context)
                    print(f"warning: {notice}", file=sys.stderr)
                typer.echo(json.dumps(result, ensure_ascii=False))
                return
            from lmcli.model import fastpath

            with fastpath.inference(ckpt.model):  # one scope for every reply
                run_terminal(session, str(ckpt.path))
        finally:
            session.close()
