"""`lmcli chat`: the session (history, context overflow, Ctrl-C), the terminal through a
pseudo-terminal, and the JSON mode for scripts, against the library and `lmcli serve`."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from helpers import assert_one_line_error, make_run, run_cli, train_config

from lmcli.config.commands import SampleConfig, ServeConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import Checkpoint
from lmcli.formats.sources import load_model
from lmcli.generate.chat import ChatSession
from lmcli.text import chat_template

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["--temperature", "0.9", "--top-k", "12", "--seed", "7"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer char model of context 64."""
    return make_run(tmp_path_factory.mktemp("chat") / "run", block_size=64)


@pytest.fixture(scope="module")
def checkpoint(chat_run: Path) -> Checkpoint:
    return load_model(chat_run)


def session(ckpt: Checkpoint, **settings) -> ChatSession:
    return ChatSession.from_checkpoint(ckpt, SampleConfig(**settings))


# ----------------------------------------------------------------------------- the session


def test_reply_renders_the_history_with_the_chat_template(checkpoint: Checkpoint) -> None:
    s = session(checkpoint, max_new_tokens=6, temperature=0.9, seed=3)
    first = s.say("the cat")
    s.say("a bird")
    expected = chat_template.encode(
        [
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "a bird"},
        ],
        None,
        checkpoint.tokenizer,
    )
    s.messages.pop()  # the prompt of the second reply: everything before it
    assert s.prompt_ids() == expected
    s.reset()
    assert s.say("the cat").text == first.text  # same seed, no history: the same reply


def test_full_context_drops_the_oldest_turns(checkpoint: Checkpoint) -> None:
    s = session(checkpoint, max_new_tokens=8, min_new_tokens=8, temperature=1.0, seed=1)
    dropped = []
    for i in range(6):
        reply = s.say(f"the dog {i}")
        dropped.append(reply.dropped)
        assert len(s.prompt_ids()) <= 64  # the prompt with the reply still fits
        assert s.window()[0]["role"] == "user"  # a turn is dropped whole
    assert dropped[0] == 0 and sum(dropped) > 0 and all(d % 2 == 0 for d in dropped)
    assert [m["content"] for m in s.conversation()[::2]] == [f"the dog {i}" for i in range(6)]
    s.set_system("be brief")
    reply = s.say("the sun")
    assert s.window()[0] == {"role": "system", "content": "be brief"}  # the system prompt stays
    assert s.window()[-1]["content"] == reply.text
    before = (list(s.messages), s.first)
    with pytest.raises(LmcliError, match="no room for a reply"):
        s.say("the cat sat on the mat " * 3)  # alone longer than the context
    assert (s.messages, s.first) == before  # nothing lost to a message that cannot fit


def test_turns_reuse_the_history_and_reply_the_same(checkpoint: Checkpoint) -> None:
    """The session's prefix cache: each turn prefills only what is new, replies as without it."""
    from lmcli.generate.prefix_cache import PrefixCache

    replies = {}
    for cached in (True, False):
        s = session(checkpoint, max_new_tokens=6, min_new_tokens=6, temperature=1.0, seed=5)
        if not cached:
            s.prefixes = PrefixCache(0)  # holds nothing
        s.set_system("the cat sat")
        replies[cached] = [s.say(f"dog {i}").text for i in range(4)]  # the last turns drop the oldest
        reused = s.prefixes.cached_tokens
        assert reused > 3 * 16 if cached else reused == 0
    assert replies[True] == replies[False]


def test_interrupted_reply_keeps_what_was_shown(checkpoint: Checkpoint) -> None:
    s = session(checkpoint, max_new_tokens=40, min_new_tokens=40, temperature=1.0)
    pieces: list[str] = []

    def ctrl_c_after_three(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    reply = s.say("the cat", on_text=ctrl_c_after_three)
    assert reply.finish_reason == "interrupted" and reply.text == "".join(pieces)
    assert s.conversation()[-1] == {"role": "assistant", "content": reply.text}
    assert s.say("the dog").finish_reason == "length"  # the session goes on
    assert len(s.conversation()) == 4

    def ctrl_c_in_the_prompt(*_) -> None:
        raise KeyboardInterrupt

    hook = checkpoint.model.register_forward_pre_hook(ctrl_c_in_the_prompt)
    try:
        reply = s.say("a bird")
    finally:
        hook.remove()
    assert reply.finish_reason == "interrupted" and reply.text == ""
    assert len(s.conversation()) == 4  # nothing shown: the question is dropped with the reply


# ----------------------------------------------------------------------------- --json


def test_json_reply_equals_the_library_and_serve(
    chat_run: Path, checkpoint: Checkpoint, capsys, monkeypatch
) -> None:
    messages = [
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat."},
        {"role": "user", "content": "a dog"},
    ]  # 50 tokens: with 12 new ones, within the context of 64
    stdin = json.dumps({"messages": messages})
    code, out, _ = run_cli(
        ["chat", str(chat_run), "--max-new-tokens", "12", *SETTINGS], capsys, stdin, monkeypatch
    )
    assert code == 0
    got = json.loads(out)
    s = session(checkpoint, max_new_tokens=12, temperature=0.9, top_k=12, seed=7)
    s.load(messages)
    reply = s.reply()
    assert got["message"] == {"role": "assistant", "content": reply.text}
    assert got["finish_reason"] == reply.finish_reason
    assert got["usage"]["prompt_tokens"] == len(chat_template.encode(messages, None, checkpoint.tokenizer))
    assert got["dropped_messages"] == 0
    longer = [
        {"role": "system", "content": "be brief"},
        *messages[:2],
        {"role": "user", "content": "the dog sat"},
    ]
    code, out, err = run_cli(
        ["chat", str(chat_run), "--max-new-tokens", "12"], capsys, json.dumps(longer), monkeypatch
    )
    assert code == 0 and json.loads(out)["dropped_messages"] == 2
    assert err.startswith("warning: [context of 64 tokens full: left out the 2 oldest message(s)]")
    httpx = pytest.importorskip("httpx2")  # the serve extra's
    pytest.importorskip("uvicorn")
    from lmcli.serve.server import running

    assert s.reply_seed() == 7 + 2  # reply k of a conversation draws with seed + k
    body = {"messages": messages, "max_tokens": 12, "temperature": 0.9, "top_k": 12, "seed": 7 + 1}
    with running(checkpoint, ServeConfig(port=0, max_batch=2, grace=1)) as (url, _):
        served = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
    assert served["choices"][0]["message"]["content"] == reply.text
    assert served["choices"][0]["finish_reason"] == reply.finish_reason


TOO_LONG = json.dumps([{"role": "user", "content": "the cat sat " * 6}])  # 89 tokens with the template


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        (TOO_LONG, "the prompt is 89 tokens: no room for a reply in this model's context of 64 tokens"),
        ("{not json", "stdin is not valid JSON"),
        ("", "no input"),
        ('{"msgs": []}', 'must have "messages"'),
        ("[]", "messages must be a non-empty list"),
        ('[{"role": "bot", "content": "hi"}]', "role must be one of system, user, assistant"),
        (
            '[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]',
            "the last message must be",
        ),
        ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]', "may only come first"),
        ('[{"role": "user", "content": 3}]', "content must be text"),
    ],
)
def test_json_bad_input_is_one_line(chat_run: Path, capsys, monkeypatch, stdin: str, message: str) -> None:
    code, out, err = run_cli(["chat", str(chat_run), "--json"], capsys, stdin, monkeypatch)
    assert_one_line_error(code, err, message)
    assert out == ""


def test_system_prompt_given_twice_and_translation_models_are_refused(
    chat_run: Path, checkpoint: Checkpoint, capsys, monkeypatch
) -> None:
    stdin = json.dumps([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    code, _, err = run_cli(["chat", str(chat_run), "--system", "be brief"], capsys, stdin, monkeypatch)
    assert_one_line_error(code, err, "give the system prompt once: --system or a system message")
    translation = dataclasses.replace(checkpoint, train_config=train_config(task="translation"))
    with pytest.raises(LmcliError, match="this is a translation model"):
        ChatSession.from_checkpoint(translation, SampleConfig())


# ----------------------------------------------------------------------------- the terminal


def as_typed_in_a_terminal() -> None:
    """In the child before exec: the pseudo-terminal becomes its controlling terminal, and
    Ctrl-C, Ctrl-\\ and hang-up get their default dispositions, as for a command a shell starts.
    An ignored signal survives exec and Python keeps it ignored: a suite started as a shell's
    background job (`make test &`, `nohup`) runs with SIGINT and SIGQUIT (and SIGHUP) ignored,
    and a chat started from it could not be interrupted."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


class Terminal:
    """``lmcli chat ARGS`` on a pseudo-terminal that is its controlling terminal (so ``\\x03``
    is a SIGINT, as a Ctrl-C typed in a terminal), read with timeouts."""

    def __init__(self, *args: str) -> None:
        master, slave = os.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcli", "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=as_typed_in_a_terminal,
        )
        os.close(slave)
        self.fd = master
        self.out = ""  # everything read so far
        self.pos = 0  # what ``until`` has consumed

    def read(self, timeout: float) -> str:
        """The bytes that are there within ``timeout`` seconds ('' if none)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return ""
        try:
            chunk = os.read(self.fd, 65536).decode("utf-8", "replace")
        except OSError:  # the child has gone
            return ""
        self.out += chunk
        return chunk

    def until(self, marker: str, timeout: float = 60.0) -> str:
        """Everything from the last marker up to and including the next ``marker``."""
        deadline = time.monotonic() + timeout
        while marker not in self.out[self.pos :]:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} within {timeout}s; got: {self.out[self.pos :]!r}")
            if not self.read(0.5) and self.proc.poll() is not None:
                raise AssertionError(
                    f"exited {self.proc.returncode} before {marker!r}: {self.out[self.pos :]!r}"
                )
        end = self.out.index(marker, self.pos) + len(marker)
        text, self.pos = self.out[self.pos : end], end
        return text

    def wait_for_key(self, timeout: float = 20.0) -> None:
        """Wait until the child is blocked reading the terminal. readline prints the prompt just
        before it waits for a key, and a SIGINT in between is only seen at the next key (as in
        Python's own REPL): a person is never that fast, a test on a busy machine can be."""
        wchan = Path(f"/proc/{self.proc.pid}/wchan")
        if not wchan.exists():  # not Linux: give it time
            time.sleep(1.0)
            return
        deadline = time.monotonic() + timeout
        while not any(w in wchan.read_text() for w in ("poll", "select")):
            assert time.monotonic() < deadline, f"not waiting for a key after {timeout}s"
            time.sleep(0.05)

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> int:
        """The exit code (the child is killed if it has not exited within 20 s)."""
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after 20 s; its output: {self.out!r}") from None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            os.close(self.fd)


PROMPT = "> "


@pytest.mark.slow
def test_terminal_streams_and_ctrl_c_stops_the_reply(tmp_path: Path) -> None:
    run = make_run(tmp_path / "long", block_size=4096)  # replies of thousands of tokens
    n = 3000
    term = Terminal(str(run), "--max-new-tokens", str(n), "--min-new-tokens", str(n), "--temperature", "1")
    try:
        term.until(PROMPT)
        term.send("the cat\n")
        term.until("the cat\r\n")  # the echo
        chunks = []
        while len(chunks) < 2 or sum(len(c) for c in chunks) < 20:  # the reply arrives in pieces
            chunk = term.read(30)
            assert chunk, "no reply text within 30 s"
            assert PROMPT not in chunk and "[reply" not in chunk  # ... before it ends
            chunks.append(chunk)
        term.send("\x03")  # Ctrl-C mid-reply
        shown = term.until("[reply stopped]").removesuffix("[reply stopped]")
        term.until(PROMPT)  # the session goes on
        term.send(f"/save {tmp_path / 'chat.json'}\n")
        term.until("[saved 2 message(s)")
        messages = json.loads((tmp_path / "chat.json").read_text())["messages"]
        assert messages[0] == {"role": "user", "content": "the cat"}
        assert messages[1]["role"] == "assistant"
        reply = messages[1]["content"]
        assert 20 <= len(reply) < n  # stopped, not finished
        # the reply kept is the text on the screen (give or take the piece the Ctrl-C met)
        shown = shown.replace("^C", "").replace("\r\n", "\n").removesuffix("\n")
        assert reply.startswith(shown[:-1]) and len(reply) <= len(shown) + 1
        term.until(PROMPT)
        term.wait_for_key()
        term.send("\x03")  # Ctrl-C at the prompt: quit
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()
    assert "Traceback" not in term.out


@pytest.mark.slow
def test_terminal_commands_reset_system_save_and_full_context(chat_run: Path, tmp_path: Path) -> None:
    term = Terminal(str(chat_run), "--max-new-tokens", "8", "--min-new-tokens", "8", *SETTINGS)
    saved = {}

    def save(name: str) -> list[dict]:
        term.send(f"/save {tmp_path / name}\n")
        term.until(f"to {tmp_path / name}]")
        term.until(PROMPT)
        saved[name] = json.loads((tmp_path / name).read_text())["messages"]
        return saved[name]

    try:
        term.until(PROMPT)
        term.send("the cat\n")
        term.until(PROMPT)
        first = save("first.json")
        assert [m["role"] for m in first] == ["user", "assistant"]
        term.send("/reset\n")
        term.until("[conversation cleared]")
        term.until(PROMPT)
        term.send("the cat\n")
        term.until(PROMPT)
        assert save("after-reset.json") == first  # the old turn is gone: the same reply again
        term.send("/system be brief\n")
        term.until("[system prompt set]")
        term.until(PROMPT)
        assert save("system.json")[0] == {"role": "system", "content": "be brief"}
        term.send("/help\n")
        assert "/save FILE" in term.until(PROMPT)
        term.send("/nope\n")
        assert "unknown command /nope" in term.until(PROMPT)
        term.send(f"/save {tmp_path / 'missing' / 'x.json'}\n")
        assert "error: cannot write" in term.until(PROMPT)  # and the session goes on
        for i in range(3):  # each turn is about 30 of the 64 tokens
            term.send(f"the dog sat {i}\n")
            term.until(PROMPT)
        assert "left out the 2 oldest message(s)" in term.out
        term.send("\x04")  # Ctrl-D
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()
    assert "Traceback" not in term.out
